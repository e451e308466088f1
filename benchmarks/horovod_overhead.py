"""Step time of mpt's ``horovod`` backend against a hand-written Horovod loop, in one run.

    .venv/bin/mpt launch --backend horovod --gpus 2 benchmarks/horovod_overhead.py
    .venv/bin/mpt launch --backend horovod --gpus 2 --bucket-mb 0 \
        benchmarks/horovod_overhead.py --fusion-only     # per-tensor allreduce
    .venv/bin/mpt launch --backend horovod --gpus 2 benchmarks/horovod_overhead.py --fusion-only

Both sides train the same MLP (same initial weights, same batches, AdamW, clip 1.0) in the same
processes on the same Horovod: side "mpt" goes through ``rt.backward/clip_grad_norm_/step``; side
"raw" is what the Horovod documentation shows (``hvd.DistributedOptimizer``, backward,
``optimizer.synchronize()``, clip, ``with optimizer.skip_synchronize(): optimizer.step()``).
Timed steps come in rounds, A then B, the side going first alternating, so machine noise falls on
both; a step's time is the max over ranks (gathered outside the timing); each side's figure is
the median step. After the run both sides' weights are compared: they must be equal.

``--fusion-only`` times the raw loop on a model of 1,000 small parameters (32 values each):
Horovod's tensor fusion packs their allreduces into one buffer. Fusion is set when Horovod starts
(HOROVOD_FUSION_THRESHOLD, from `mpt launch --bucket-mb`), so the fused and per-tensor
figures come from two runs; their ratio is in docs/benchmarks.md.
This is a benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable

import horovod
import horovod.torch as hvd
import torch
from torch import nn

import mpt
from mpt.environments.host_memory import apply_host_memory

GOAL = 1.02
StepFn = Callable[[int], None]


class ManySmall(nn.Module):
    """1,000 parameters of 32 values: allreduce latency, not bandwidth, decides the step."""

    def __init__(self, count: int = 1000, width: int = 32) -> None:
        super().__init__()
        self.parts = nn.ParameterList(nn.Parameter(torch.randn(width) * 0.01)
                                      for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.stack(list(self.parts)).sum(0)


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def raw_step_fn(model: nn.Module, optimizer: torch.optim.Optimizer,
                batches: list[tuple[torch.Tensor, ...]], loss_fn: Callable) -> StepFn:
    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        optimizer.zero_grad()  # Horovod's takes no argument; torch's default: set to None
        loss_fn(model(x), y).backward()
        optimizer.synchronize()  # type: ignore[attr-defined]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            optimizer.step()
    return step


def mpt_step_fn(rt: mpt.Runtime, model: nn.Module, batches: list[tuple[torch.Tensor, ...]],
                loss_fn: Callable) -> StepFn:
    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        with rt.autocast():
            loss = loss_fn(model(x), y)
        rt.backward(loss)
        rt.clip_grad_norm_(1.0)
        rt.step()
    return step


def timed(step: StepFn, start: int, count: int) -> torch.Tensor:
    """Per-step times in ms, max over ranks (the allreduce runs after the timed steps)."""
    times = []
    for i in range(start, start + count):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return hvd.allreduce(torch.tensor(times, dtype=torch.float64) * 1e3, op=hvd.Max)


def median(t: torch.Tensor) -> float:
    return float(torch.quantile(t, 0.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--fusion-only", action="store_true",
                        help="time the raw loop on 1,000 small parameters only")
    args = parser.parse_args()
    # Both sides share one allocator: without this, glibc returns freed gradient memory to the
    # OS and page faults, not mpt, decided the ratio (1.03-1.05 without, 0.91-0.99 with).
    malloc = "steady" if apply_host_memory("steady") is None else "default"
    torch.manual_seed(0)
    rt = mpt.Runtime(backend="horovod", quiet=True)  # no progress lines: raw prints none
    gen = torch.Generator().manual_seed(1000 + rt.rank)
    if args.fusion_only:
        model = ManySmall()
        batches = [(torch.randn(args.batch_size, 32, generator=gen),) * 2 for _ in range(8)]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters())
        step = raw_step_fn(model, opt, batches, lambda out, _: out.square().mean())
        for i in range(args.warmup):
            step(i)
        t = torch.cat([timed(step, args.warmup + r * args.steps, args.steps)
                       for r in range(args.rounds)])
        fusion = os.environ.get("HOROVOD_FUSION_THRESHOLD", "default (64 MB)")
        rt.print(f"horovod fusion: 1,000 params x 32, HOROVOD_FUSION_THRESHOLD={fusion}: "
                 f"median step {median(t):.3f} ms over {len(t)} steps")
        rt.close()
        return

    base = mlp(args.hidden)
    raw_module = copy.deepcopy(base)
    batches = [(torch.randn(args.batch_size, 512, generator=gen),
                torch.randint(0, 10, (args.batch_size,), generator=gen)) for _ in range(8)]
    loss_fn = nn.CrossEntropyLoss()
    hvd.broadcast_parameters(raw_module.state_dict(), root_rank=0)
    raw_opt = hvd.DistributedOptimizer(
        torch.optim.AdamW(raw_module.parameters(), lr=1e-3),
        named_parameters=[(f"raw.{n}", p) for n, p in raw_module.named_parameters()])
    mpt_model, mpt_opt = rt.setup(base, torch.optim.AdamW(base.parameters(), lr=1e-3))
    sides = {"mpt": mpt_step_fn(rt, mpt_model, batches, loss_fn),
             "raw": raw_step_fn(raw_module, raw_opt, batches, loss_fn)}
    for step in sides.values():
        for i in range(args.warmup):
            step(i)
    times: dict[str, list[torch.Tensor]] = {"mpt": [], "raw": []}
    for r in range(args.rounds):
        for name in ("mpt", "raw") if r % 2 == 0 else ("raw", "mpt"):
            times[name].append(timed(sides[name], args.warmup + r * args.steps, args.steps))
            (mpt_opt if name == "mpt" else raw_opt).zero_grad()  # same state for both
    mpt_ms, raw_ms = median(torch.cat(times["mpt"])), median(torch.cat(times["raw"]))
    with torch.no_grad():
        diff = max(float((p - q).abs().max())
                   for p, q in zip(base.parameters(), raw_module.parameters(), strict=True))
    rt.print(f"horovod overhead: {rt.world_size} processes, horovod {horovod.__version__} gloo, "
             f"torch {torch.__version__}, MLP 512-{args.hidden}-{args.hidden}-10, batch "
             f"{args.batch_size}/process, {args.rounds}x{args.steps} timed steps per side, "
             f"malloc {malloc}")
    rt.print(f"check: max |w_mpt - w_raw| = {diff:.3g}")
    rt.print(f"horovod fp32: mpt {mpt_ms:.2f} ms, raw {raw_ms:.2f} ms, ratio "
             f"{mpt_ms / raw_ms:.3f} (goal <= {GOAL})")
    rt.close()


if __name__ == "__main__":
    main()
