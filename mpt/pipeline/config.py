"""Pipeline settings and the rank layout they imply, checked before any process starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpt.errors import UsageError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb")
"""``--pipeline-schedule`` values: torch.distributed.pipelining's GPipe, 1F1B, interleaved 1F1B
and interleaved zero bubble (two model chunks per rank), each checked on gloo. Not ZBV: torch
2.14's ScheduleZBVZeroBubble fails the training step after an evaluation ("can't
steal_bwd_input if this stage doesn't have backward")."""
LOOPED = {"interleaved-1f1b": 2, "interleaved-zb": 2}
"""Model chunks per rank of the schedules that give a rank several."""
ZERO_BUBBLE = frozenset({"interleaved-zb"})
"""Schedules that split a backward in two: the inputs' gradients first, the weights' later."""


def schedule_class(name: str) -> type:
    """torch's schedule class of ``--pipeline-schedule`` ``name`` (one of ``SCHEDULES``)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
            "interleaved-1f1b": ScheduleInterleaved1F1B,
            "interleaved-zb": ScheduleInterleavedZeroBubble}[name]


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelinePlan:
    """How the model is cut over ranks, and the batch over micro-batches."""

    stages: int
    """Ranks one model replica spans (P); the world is P x the data-parallel size."""
    schedule: str
    """Order of micro-batch forwards and backwards (``SCHEDULES``)."""
    microbatches: int
    """Micro-batches each replica's batch is cut into per ``rt.forward_backward`` (M)."""
    split: tuple[str, ...] = ()
    """Names of the blocks where stages 1.. start; empty: balanced by parameter count."""

    @property
    def split_backward(self) -> bool:
        """Whether the schedule computes the weights' gradients after the inputs' (zero
        bubble): a backend that frees gathered weights after the forward cannot run it."""
        return self.schedule in ZERO_BUBBLE

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks each rank holds (2 under a looped schedule)."""
        return LOOPED.get(self.schedule, 1)

    @property
    def chunks(self) -> int:
        """Pieces the model is cut into."""
        return self.stages * self.chunks_per_rank

    def holder(self, chunk: int) -> int:
        """The stage (pipeline rank) that holds model chunk ``chunk``: round robin."""
        return chunk % self.stages

    def chunks_of(self, stage: int) -> list[int]:
        """The model chunks stage ``stage`` holds, in forward order."""
        return [chunk for chunk in range(self.chunks) if self.holder(chunk) == stage]

    @property
    def bubble(self) -> float:
        """The idle fraction of a step of GPipe or 1F1B: (P - 1) / (M + P - 1)."""
        return (self.stages - 1) / (self.microbatches + self.stages - 1)


def parse_stages(argument: str, value: Any) -> tuple[int, ...]:
    """``--pipeline-stages``: P, or stage counts in order of preference (``2,1``), of which each
    world of an elastic job runs the first that divides it."""
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    try:
        counts = tuple(int(str(item).strip()) for item in items)
    except ValueError:
        raise UsageError(argument, value, "it is not a whole number, nor such numbers "
                         "separated by commas", f"pass {argument} 2, or 2,1") from None
    if not counts or min(counts) < 1:
        raise UsageError(argument, value, "every stage count must be at least 1",
                         f"pass {argument} 1 (no pipeline), 2, ..., or counts in order of "
                         "preference such as 2,1")
    if len(set(counts)) < len(counts):
        raise UsageError(argument, value, "a stage count is listed twice",
                         f"pass each count once, e.g. {argument} "
                         f"{','.join(map(str, dict.fromkeys(counts)))}")
    return counts


def plan_pipeline(stages: int, schedule: str, microbatches: int | None,
                  split: str | None) -> PipelinePlan:
    """The plan, or a UsageError naming the flag (M >= P; that P divides the world is the
    ``ParallelPlan``'s check)."""
    if stages < 1:
        raise UsageError("--pipeline-stages", stages, "it must be at least 1",
                         "pass 1 (no pipeline) or more")
    if schedule not in SCHEDULES:
        raise UsageError("--pipeline-schedule", schedule, "torch has no such schedule here",
                         f"pass one of {', '.join(SCHEDULES)}")
    count = 2 * stages if microbatches is None else microbatches
    if count < stages and schedule in ("gpipe", "1f1b"):
        raise UsageError("--microbatches", count, f"{schedule} keeps every one of the "
                         f"{stages} stages busy only with as many micro-batches as stages",
                         f"pass --microbatches {stages} or more")
    if schedule in LOOPED and count % stages:
        raise UsageError("--microbatches", count, f"{schedule} runs micro-batches in rounds "
                         f"of {stages} (the stages)", f"pass a multiple of {stages}")
    names = tuple(name for name in (split or "").split(",") if name)
    return PipelinePlan(stages=stages, schedule=schedule, microbatches=count, split=names)
