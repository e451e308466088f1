"""The A/B protocol of the workload benchmarks (their folder is on sys.path), in one place.

Both sides (mpt and plain torch) train the same model from the same weights on the same batches
in the same processes. After untimed warm-up steps, the timed steps come in rounds, one segment
per side, the side that goes first alternating, so that machine noise falls on both. A step's
time is the slowest rank's (a MAX all-reduce outside the timing). ``ddp_overhead.py`` documents
why gradients are freed between segments and why glibc is told to keep freed memory.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from ddp_overhead import bootstrap_ratio, max_over_ranks, median, run_segment
from torch import nn

StepFn = Callable[[int], None]


@dataclass(frozen=True)
class Comparison:
    """Median step times (ms) of the two sides and the spread of their ratio."""

    a_ms: float
    b_ms: float
    ci: tuple[float, float]
    round_ratios: list[float]
    steps_per_side: int

    @property
    def ratio(self) -> float:
        return self.a_ms / self.b_ms


def compare(a: StepFn, b: StepFn, optimizers: tuple[torch.optim.Optimizer, ...], *,
            warmup: int, rounds: int, steps: int, sync: Callable[[], None],
            bootstrap: int = 2000) -> Comparison:
    """Time ``a`` against ``b`` in alternating rounds (every rank calls it)."""
    sides = {"a": a, "b": b}
    cursor = dict.fromkeys(sides, warmup)
    for step in sides.values():  # warm-up, not timed
        for i in range(warmup):
            step(i)
    times: dict[str, list[torch.Tensor]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in (("a", "b") if r % 2 == 0 else ("b", "a")):
            gc.collect()
            dist.barrier()  # both ranks start the segment together; outside the timing
            segment = run_segment(sides[name], cursor[name], steps, sync)
            for optimizer in optimizers:  # no side holds gradients through the other's segment
                optimizer.zero_grad(set_to_none=True)
            cursor[name] += steps
            times[name].append(max_over_ranks(segment))
    a_t, b_t = torch.cat(times["a"]), torch.cat(times["b"])
    return Comparison(
        a_ms=median(a_t), b_ms=median(b_t), ci=bootstrap_ratio(a_t, b_t, bootstrap),
        round_ratios=[median(x) / median(y) for x, y in zip(times["a"], times["b"], strict=True)],
        steps_per_side=len(a_t))


def max_weight_difference(a: nn.Module, b: nn.Module) -> float:
    """Same initial weights, batches and arithmetic on both sides: 0.0, or the loops differ."""
    with torch.no_grad():
        return max(float((p - q).abs().max())
                   for p, q in zip(a.parameters(), b.parameters(), strict=True))


def describe(c: Comparison, a: str = "mpt", b: str = "raw") -> str:
    """The spread lines every workload benchmark prints under its figures."""
    return (f"bootstrap 95% CI of the ratio [{c.ci[0]:.3f}, {c.ci[1]:.3f}] (too narrow: it "
            f"takes steps as independent); per-round ratios median "
            f"{statistics.median(c.round_ratios):.3f}, range {min(c.round_ratios):.3f}.."
            f"{max(c.round_ratios):.3f}; {c.steps_per_side} timed steps per side "
            f"({a} {c.a_ms:.2f} ms, {b} {c.b_ms:.2f} ms median)")
