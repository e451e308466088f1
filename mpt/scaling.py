"""Global batch size and learning-rate scaling: the "effective batch size" made explicit.

Going from one GPU to N changes the batch an optimizer step sees: ``global batch = world size x
per-rank batch x accumulation steps``. Scripts that fix the per-rank batch silently train with
a larger batch on more GPUs; scripts that want a fixed global batch have to divide by hand.
``--global-batch-size B`` states the global batch once, and mpt derives the rest, refusing
combinations that do not divide evenly instead of rounding them.

``--lr-scaling linear|sqrt`` is opt-in: the learning rate is multiplied by the world size
(Goyal et al., for SGD) or by its square root (often preferred for Adam).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpt.errors import UsageError

LR_RULES = ("linear", "sqrt")
"""Names of the learning-rate scaling rules ``--lr-scaling`` accepts."""


def _whole(argument: str, value: object) -> int:
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if number < 1:
        raise UsageError(argument, value, "it must be a whole number of at least 1",
                         f"pass {argument} 1 or more")
    return number


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPlan:
    """How one optimizer step's global batch is split over processes and micro-batches."""

    global_batch_size: int
    """Samples per optimizer step, over all processes and micro-batches."""
    world_size: int
    """Processes in the job."""
    batch_size: int
    """Samples per micro-batch on each process: the DataLoader's ``batch_size``."""
    accumulate: int
    """Micro-batches per optimizer step on each process."""

    def describe(self) -> str:
        return (f"global batch {self.global_batch_size} = {self.world_size} process(es) x "
                f"{self.batch_size} per micro-batch x {self.accumulate} accumulation step(s)")


def plan_batch(global_batch_size: int | str, world_size: int, *, batch_size: int | None = None,
               accumulate: int | None = None) -> BatchPlan:
    """Split ``global_batch_size`` over ``world_size`` processes.

    With the script's per-rank ``batch_size``, the accumulation steps follow; otherwise the
    per-rank batch follows from ``accumulate`` (1 when not given). Both given must agree.
    """
    total = _whole("--global-batch-size", global_batch_size)
    if batch_size is not None and accumulate is not None:
        if total != world_size * batch_size * accumulate:
            raise UsageError("--global-batch-size", total, f"it must equal world size x batch "
                             f"size x accumulation = {world_size} x {batch_size} x {accumulate} "
                             f"= {world_size * batch_size * accumulate}",
                             "give the runtime only one of batch_size and accumulate, "
                             "so that mpt derives the other")
        return BatchPlan(global_batch_size=total, world_size=world_size, batch_size=batch_size,
                         accumulate=accumulate)
    if batch_size is not None:
        per_step = world_size * _whole("batch_size", batch_size)
        what = f"world size x batch size = {world_size} x {batch_size}"
    else:
        accumulate = _whole("accumulate", 1 if accumulate is None else accumulate)
        per_step = world_size * accumulate
        what = f"world size x accumulation = {world_size} x {accumulate}"
    if total % per_step:
        below, above = total // per_step * per_step, (total // per_step + 1) * per_step
        nearest = f"{below} or {above}" if below else str(above)
        raise UsageError("--global-batch-size", total, f"it is not a multiple of {what} = "
                         f"{per_step}", f"pass --global-batch-size {nearest}, or change the "
                         "number of processes")
    if batch_size is not None:
        return BatchPlan(global_batch_size=total, world_size=world_size, batch_size=batch_size,
                         accumulate=total // per_step)
    return BatchPlan(global_batch_size=total, world_size=world_size,
                     batch_size=total // per_step, accumulate=accumulate or 1)


def check_lr_scaling(rule: str | None) -> str | None:
    """``rule`` if it names a scaling rule (None: no scaling), else a UsageError."""
    if rule is None or rule == "" or rule == "none":
        return None
    if rule not in LR_RULES:
        raise UsageError("--lr-scaling", rule, "unknown learning-rate scaling rule",
                         f"use one of {', '.join(LR_RULES)}, or leave it out to keep the lr")
    return rule


def lr_factor(rule: str | None, world_size: int) -> float:
    """What ``rule`` multiplies the learning rate by in a job of ``world_size`` processes."""
    rule = check_lr_scaling(rule)
    if rule == "linear":
        return float(world_size)
    if rule == "sqrt":
        return math.sqrt(world_size)
    return 1.0
