"""Judging one conformance cell: P (matches ddp fp32), R (refused before start) or F.

Deviations are relative: the largest over the steps of |loss - reference| / reference, and for
the weights ||W - W_ref|| / ||W_ref - W_0|| over all parameters (the distance from the
reference's weights as a fraction of the distance the reference trained them from their initial
values W_0). Tolerances: see ``FP32_TOLERANCE``, ``TOLERANCE_FACTOR`` and ``FLOOR``.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from conformance_model import RECIPE_OF, RECIPES, initial_params, plain_run

BACKENDS = ("ddp", "apex", "horovod", "deepspeed", "fsdp")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "O0", "O1", "O2", "O3", "O2-bf16")
SHAPES = ((1, 1), (1, 2), (2, 1), (2, 2))
"""(world size, accumulation) pairs: the four letters of a table cell, in this order."""
FP32_CLASS = ("fp32", "O0")
COMPRESSIONS = ("fp16", "bf16", "powersgd")
"""``--grad-compression`` values of the grid's compression rows (``none`` is every other row)."""
POWERSGD_OPTIONS = {"powersgd_start_step": 2, "powersgd_rank": 4}
"""PowerSGD from the first step DDP allows (torch's default, 1000, is past the job's end), at
the rank that keeps the job's largest gradient matrix (16 x 144) compressed."""
COMPRESSED_AS = {"fp16": "fp16-mixed", "bf16": "bf16-mixed"}
"""The precision whose mixed-precision tolerance a cast compression is held to."""
LOST_UPDATE = "update 6 of 10 lost"
"""The planted bug whose deviation is PowerSGD's limit (see ``judge_run``)."""

FP32_TOLERANCE = 1e-5
"""Deviation allowed to fp32 cells: float32 summation in another order (bucketed allreduce,
sharded optimizer steps) moves results by ~1e-7 relative; 1e-5 leaves room for 10 steps."""
TOLERANCE_FACTOR = 4.0
"""A mixed cell may deviate from the fp32 reference this many times as much as plain torch's
loop deviates from plain torch fp32 in the worst recipe of the same dtype. The recipes' figures
move by about 2x from one world size, accumulation or data order to another; 4 is that spread
with a margin of 2. A wrong gradient scale (loss scale not undone, a sum for a mean,
accumulation not divided), a lost step or a precision not applied is off by far more."""
FLOOR = 2.0**-11
"""Least tolerance of mixed cells, on losses and weights: one rounding of an fp16 value."""


@dataclass(frozen=True)
class Cell:
    backend: str
    precision: str
    world_size: int
    accumulate: int
    zero_stage: int | None = None
    compression: str = "none"
    stages: int = 1
    """``--pipeline-stages``: with P > 1 the job runs P x ``world_size`` processes, and
    ``world_size`` is its data-parallel size (each replica's stages read the same data)."""
    replicate: int = 1
    """``--fsdp-replicate`` (HSDP): ``world_size`` ranks in R replicas of world/R shards."""
    tp: int = 1
    """``--tensor-parallel``: like stages, T x the processes, each tp group reading one batch."""

    @property
    def row(self) -> str:
        stage = self.zero_stage
        row = self.backend if stage is None else f"{self.backend} (ZeRO-{stage})"
        if self.stages > 1:
            row += f" --pipeline-stages {self.stages}"
        if self.replicate > 1:
            row += f" --fsdp-replicate {self.replicate}"
        if self.tp > 1:
            row += f" --tensor-parallel {self.tp}"
        return row if self.compression == "none" else f"{row} --grad-compression {self.compression}"

    @property
    def shape(self) -> str:
        return f"ws{self.world_size} acc{self.accumulate}"

    @property
    def processes(self) -> int:
        return self.world_size * self.stages * self.tp

    def __str__(self) -> str:
        return f"{self.row} {self.precision} {self.shape}"


@dataclass
class Run:
    """What a cell's ranks wrote."""

    losses: list[float]
    """Per optimizer step: the mean loss of its micro-batches over all ranks."""
    schedule: list[list[list[int]]]
    """``schedule[step][k]``: sample indices of the step's k-th micro-batch (rank-major)."""
    params: dict[str, torch.Tensor]
    stepped: list[bool]
    """Per optimizer step: whether every rank's ``rt.step()`` stepped at its boundary."""
    off_boundary_steps: int
    """``rt.step()`` calls that stepped while accumulating (must be 0)."""


@dataclass
class Outcome:
    cell: Cell
    verdict: str  # "P", "R" or "F"
    detail: str
    seconds: float
    loss_dev: float | None = None
    weight_dev: float | None = None
    limits: tuple[float, float] | None = None


def relative(got: Sequence[float], want: Sequence[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def weight_deviation(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want - initial|| over all parameters: the error as a fraction of the
    update training made. Relative to the weights themselves, an update half lost would read as
    a few percent, diluted by initial values that no step touched."""
    if got.keys() != want.keys():
        raise ValueError(f"weights {sorted(got)} are not the reference's {sorted(want)}")
    start = initial_params()
    error = sum(float((got[k].double() - want[k].double()).pow(2).sum()) for k in want)
    update = sum(float((want[k].double() - start[k].double()).pow(2).sum()) for k in want)
    return math.sqrt(error / update)


def finite(run: Run) -> bool:
    return all(math.isfinite(v) for v in run.losses) and all(
        bool(torch.isfinite(t).all()) for t in run.params.values())


def judge_refusal(cell: Cell, result: subprocess.CompletedProcess[str], out: Path,
                  seconds: float) -> Outcome:
    started = len(list(out.glob("started-*")))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    problems = []
    if started:
        problems.append(f"{started} worker(s) had started")
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr")
    if "Traceback" in result.stderr:
        problems.append("a traceback")
    text = " ".join(lines)
    named = cell.precision if cell.compression == "none" else \
        f"--grad-compression={cell.compression} "
    if cell.backend not in text or named not in text:
        problems.append("the message does not name backend and "
                        + ("precision" if cell.compression == "none" else "compression"))
    message = lines[-1].strip() if lines else "(no message)"
    if problems:
        return Outcome(cell, "F", f"exit 2 but {', '.join(problems)}: {message[:300]}", seconds)
    return Outcome(cell, "R", message[:300], seconds)


def judge_run(cell: Cell, run: Run, reference: Run, baseline: tuple[float, float] | None,
              seconds: float, planted: dict[str, tuple[float, float]] | None = None) -> Outcome:
    """Compare a cell that trained with the reference run of its shape.

    PowerSGD is no precision: a low-rank approximation of each gradient, whose error feedback
    hands what it left out to the next step. Its limits are what losing one update of the ten
    does to plain torch fp32 (``planted``, measured on the reference's micro-batches), not a
    mixed-precision tolerance: measured on this job at rank 4 and 7 from step 2, it deviates
    by 1.4e-01 and 6.4e-02 on the weights, past bf16's 4e-02.
    """
    if run.schedule != reference.schedule:
        return Outcome(cell, "F", "its ranks saw other micro-batches than the reference's",
                       seconds)
    if not finite(run):
        bad = next((s for s, v in enumerate(run.losses) if not math.isfinite(v)), None)
        where = f"loss not finite from step {bad}" if bad is not None else "weights not finite"
        return Outcome(cell, "F", f"{where} (losses {[round(v, 4) for v in run.losses]})",
                       seconds)
    if run.off_boundary_steps:
        return Outcome(cell, "F", f"rt.step() stepped {run.off_boundary_steps} time(s) while "
                       "accumulating", seconds)
    loss_dev = relative(run.losses, reference.losses)
    weight_dev = weight_deviation(run.params, reference.params)
    skipped = run.stepped.count(False)
    note = f"; {skipped} step(s) skipped on overflow" if skipped else ""
    if cell.precision in FP32_CLASS and cell.compression == "none":
        limits = (FP32_TOLERANCE, FP32_TOLERANCE)
        if skipped:
            return Outcome(cell, "F", f"{skipped} fp32 step(s) did not step", seconds,
                           loss_dev, weight_dev, limits)
    else:
        found = mixed_limits(cell, baseline, planted)
        if found is None:
            return Outcome(cell, "F", f"trained, but the grid has nothing to judge {cell.row} "
                           f"{cell.precision} by", seconds, loss_dev, weight_dev)
        limits = found
        if loss_dev <= FP32_TOLERANCE and weight_dev <= FP32_TOLERANCE:
            what = "precision" if cell.compression == "none" else "compression"
            return Outcome(cell, "F", f"equal to fp32 within {FP32_TOLERANCE:g}: the {what} "
                           "was not applied", seconds, loss_dev, weight_dev, limits)
        if sum(run.losses[-3:]) / 3 >= run.losses[0]:
            return Outcome(cell, "F", f"the loss does not go down: {run.losses[0]:.4f} -> "
                           f"{run.losses[-1]:.4f}{note}", seconds, loss_dev, weight_dev, limits)
    figures = (f"loss {loss_dev:.1e} (limit {limits[0]:.1e}), weights {weight_dev:.1e} "
               f"(limit {limits[1]:.1e}){note}")
    if loss_dev > limits[0] or weight_dev > limits[1]:
        return Outcome(cell, "F", f"deviates from ddp fp32: {figures}", seconds, loss_dev,
                       weight_dev, limits)
    return Outcome(cell, "P", figures, seconds, loss_dev, weight_dev, limits)


def mixed_limits(cell: Cell, baseline: tuple[float, float] | None,
                 planted: dict[str, tuple[float, float]] | None) -> tuple[float, float] | None:
    """A mixed or compressed cell's limits on loss and weight deviation (see ``judge_run``);
    None where the grid measured nothing to scale them by."""
    if cell.compression == "powersgd":
        return None if planted is None else planted[LOST_UPDATE]
    if baseline is None:
        return None
    return (max(TOLERANCE_FACTOR * baseline[0], FLOOR),
            max(TOLERANCE_FACTOR * baseline[1], FLOOR))


def tolerance_of(baseline: dict[str, tuple[float, float]], cell: Cell
                 ) -> tuple[float, float] | None:
    """What a cell's deviations are scaled by: its precision's recipes (``worst_of_dtype``),
    and a compressed cell's compression's, whichever allow more (None: fp32 uncompressed)."""
    found = [worst_of_dtype(baseline, p) for p in (cell.precision, COMPRESSED_AS.get(
        cell.compression, "")) if p not in ("", *FP32_CLASS)]
    found = [f for f in found if f is not None]
    if not found:
        return None
    return max(f[0] for f in found), max(f[1] for f in found)


def worst_of_dtype(baseline: dict[str, tuple[float, float]], precision: str
                   ) -> tuple[float, float] | None:
    """The largest loss and weight deviations of the plain recipes computing in ``precision``'s
    dtype: each is a correct way to train in it, and a backend may map the precision onto its
    engine's own arithmetic (DeepSpeed's fp16/bf16 modes keep low-precision weights)."""
    recipe = RECIPES.get(RECIPE_OF.get(precision, ""))
    same = [devs for name, devs in baseline.items()
            if recipe is not None and RECIPES[name].low_dtype == recipe.low_dtype]
    if not same:
        return None
    return max(loss for loss, _ in same), max(weight for _, weight in same)


PLANTED: dict[str, dict[str, Any]] = {
    "gradient x4 (summed over 4 micro-batches, not averaged)": {"grad_factor": 4.0},
    "gradient x0.5 (a loss divided twice)": {"grad_factor": 0.5},
    "gradient x0.9": {"grad_factor": 0.9},
    "update 6 of 10 lost": {"lose_steps": [5]},
}
"""Bugs planted into plain torch fp32, to show how far outside the tolerances they land."""


def measure_planted(schedule: list[list[list[int]]]) -> dict[str, tuple[float, float]]:
    """The deviations of plain torch fp32 with each ``PLANTED`` bug from plain torch fp32."""
    fp32 = plain_run("fp32", schedule)
    planted = {}
    for bug, wrong in PLANTED.items():
        got = plain_run("fp32", schedule, **wrong)
        planted[bug] = (relative(got.losses, fp32.losses),
                        weight_deviation(got.params, fp32.params))
    return planted


def measure_baseline(schedule: list[list[list[int]]]) -> dict[str, tuple[float, float]]:
    """Plain torch's deviation from plain torch fp32 in each recipe of the grid's precisions,
    on these micro-batches."""
    fp32 = plain_run("fp32", schedule)
    baseline = {}
    for recipe in sorted({RECIPE_OF[p] for p in PRECISIONS} - {"fp32"}):
        got = plain_run(recipe, schedule)
        baseline[recipe] = (relative(got.losses, fp32.losses),
                            weight_deviation(got.params, fp32.params))
    return baseline
