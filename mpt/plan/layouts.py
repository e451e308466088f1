"""Every layout mpt can run for a model on a cluster, built the way `mpt launch` builds it.

Each combination of backend, the option sets it declares worth comparing
(``Backend.plan_variants``: DeepSpeed's ZeRO stages and what each may offload, fsdp's HSDP
replicas and each with its CPU offload or, under a pipeline, its resharding),
pipeline stages P with each ``--pipeline-schedule`` and ``--microbatches`` M of P, 2P, 4P and
8P that splits a replica's batch, tensor-parallel size T and, where more than one replica
reduces gradients, each ``--grad-compression`` (``COMPRESSIONS``: PowerSGD at its default rank,
priced once it has started), and without a
pipeline each ``--accumulate`` of 1, 2, 4 and 8 that splits a replica's batch, for a backend
whose accumulation the plan prices (``Backend.accumulation_priced``), goes through
``RunConfig`` and ``RunConfig.layout`` (the launcher's own checks: backend capabilities,
precision, divisibility of the world, the schedule's micro-batches), then the checks the model
meets when it is set up (``stage_blocks`` for P stages or, under a looped schedule, 2P chunks;
``tensor_plan`` for T) and the batch's (it must split over the replicas and the
micro-batches). A refused combination keeps mpt's one-line reason. T stays within a node (tp
groups are a node's consecutive ranks).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from mpt.backends import registered
from mpt.comm import COMPRESSIONS
from mpt.errors import MptError, UsageError
from mpt.parallel import divisors
from mpt.parallel.tensor import tensor_plan
from mpt.pipeline.config import SCHEDULES
from mpt.pipeline.split import stage_blocks
from mpt.plan.cost import Layout
from mpt.run_config import RunConfig

DEFAULT_SCHEDULE = RunConfig().pipeline_schedule
"""mpt's ``--pipeline-schedule`` where none is given."""
MICROBATCHES = (1, 2, 4, 8)
"""Micro-batch counts priced under P stages, as multiples of P (mpt's default: 2), and
without a pipeline as ``--accumulate``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Refused:
    """A combination mpt would not run, and why."""

    flags: tuple[str, ...]
    """The `mpt launch` flags of the combination."""
    reason: str
    """mpt's one-line refusal."""



def _flags(backend: str, options: Mapping[str, Any], pp: int, tp: int,
           compression: str = "none", schedule: str = DEFAULT_SCHEDULE,
           microbatches: int | None = None, accumulate: int = 1) -> tuple[str, ...]:
    """The `mpt launch` flags of a combination (each option by its own flag, none for an
    option at its default)."""
    cls = registered()[backend]
    flags = [f"--backend {backend}"]
    for name, value in options.items():
        option = cls.options[name]
        if value != option.default and option.is_switch:
            flags.append(option.flag)
        elif value != option.default:
            shown = ("yes" if value else "no") if isinstance(value, bool) else value
            flags.append(f"{option.flag} {shown}")
    if pp > 1:
        flags.append(f"--pipeline-stages {pp}")
        if schedule != DEFAULT_SCHEDULE:
            flags.append(f"--pipeline-schedule {schedule}")
        if microbatches is not None:
            flags.append(f"--microbatches {microbatches}")
    if tp > 1:
        flags.append(f"--tensor-parallel {tp}")
    if compression != "none":
        flags.append(f"--grad-compression {compression}")
    if accumulate > 1:
        flags.append(f"--accumulate {accumulate}")
    return tuple(flags)


def layouts(net: nn.Module, *, nodes: int, gpus: int, precision: str, batch: int,
            device_type: str) -> tuple[list[Layout], list[Refused]]:
    """Every layout of ``net`` on ``nodes`` x ``gpus`` ranks at a global batch of ``batch``,
    and every combination mpt refuses."""
    from mpt.precision import describe

    world = nodes * gpus
    spec = describe(precision)
    found: list[Layout] = []
    refused: list[Refused] = []
    for backend, cls in sorted(registered().items()):
        for pp, options, tp, compression, replicas in _combinations(cls, world, gpus):
            for schedule in _schedules(pp):
                try:
                    cls.check_precision(spec, device_type, options)
                    for m in _microbatches(cls, options, pp, batch // replicas):
                        counts = {"microbatches": m} if pp > 1 else {"accumulate": m}
                        found.append(layout(net, backend, options, pp, tp, world=world,
                                            precision=precision, batch=batch,
                                            compression=compression, schedule=schedule,
                                            **counts))
                except MptError as exc:
                    # every M priced splits the batch: a refusal holds for all
                    flags = _flags(backend, options, pp, tp, compression, schedule)
                    refused.append(Refused(flags=flags, reason=str(exc)))
                    if schedule == DEFAULT_SCHEDULE:
                        break  # at mpt's default schedule, for every schedule
    return found, refused


def _combinations(cls: type, world: int, gpus: int
                  ) -> Iterator[tuple[int, Mapping[str, Any], int, str, int]]:
    """Each (P, the backend's options, T, ``--grad-compression``, replicas) of ``world``
    ranks, ``gpus`` a node: every compression where more than one replica reduces each
    gradient (``replicas``: at least 1 where P x T exceeds the world, which mpt refuses)."""
    for pp in divisors(world):
        for options in cls.plan_variants(world, pp):
            for tp in divisors(gpus):
                replicas = world // (pp * tp)  # the ranks that reduce each gradient
                for compression in COMPRESSIONS if replicas > 1 else ("none",):
                    yield pp, options, tp, compression, max(replicas, 1)


def _schedules(pp: int) -> tuple[str, ...]:
    """The schedules priced at P stages, mpt's default first; none without a pipeline."""
    if pp == 1:
        return (DEFAULT_SCHEDULE,)
    return (DEFAULT_SCHEDULE, *(s for s in SCHEDULES if s != DEFAULT_SCHEDULE))


def _microbatches(cls: type, options: Mapping[str, Any], pp: int, per_replica: int
                  ) -> list[int]:
    """The micro-batch counts priced at P stages: every one of P, 2P, 4P and 8P
    (``MICROBATCHES``) that splits a replica's batch, else mpt's default 2P, for its refusal;
    without a pipeline, each such ``--accumulate`` where the backend prices it with
    ``options``, else 1."""
    if pp == 1:
        return [a for a in MICROBATCHES if per_replica % a == 0 and (
            a == 1 or cls.accumulation_priced(options))]
    return [f * pp for f in MICROBATCHES if per_replica % (f * pp) == 0] or [2 * pp]


def layout(net: nn.Module, backend: str, options: Mapping[str, Any], pp: int, tp: int, *,
           world: int, precision: str, batch: int, microbatches: int | None = None,
           compression: str = "none", schedule: str = DEFAULT_SCHEDULE,
           accumulate: int = 1) -> Layout:
    """The layout of one combination (``microbatches``: `mpt launch --microbatches`, mpt's
    default 2P where None; ``compression``: ``--grad-compression``; ``schedule``:
    ``--pipeline-schedule``; ``accumulate``: ``--accumulate``); a UsageError where mpt
    refuses it."""
    settings: dict[str, Any] = {"backend": backend, "backend_options": dict(options),
                                "pipeline_stages": pp, "tensor_parallel": tp,
                                "precision": precision, "grad_compression": compression,
                                "pipeline_schedule": schedule}
    if microbatches is not None:
        settings["microbatches"] = microbatches
    if accumulate > 1:
        settings["accumulate"] = accumulate
    config = RunConfig.parse(settings)
    plan = config.layout(world)
    pipeline = config.pipeline_at(world)
    if pipeline is not None:
        stage_blocks(net, pipeline.chunks)
    if tp > 1:
        tensor_plan(net, tp)
    microbatches = pipeline.microbatches if pipeline is not None else accumulate
    schedule = pipeline.schedule if pipeline is not None else DEFAULT_SCHEDULE
    per_replica, left = divmod(batch, plan.dp_size)
    if left or per_replica % microbatches:
        raise UsageError("--batch", batch, f"it does not split into {plan.dp_size} replica(s) "
                         f"x {microbatches} micro-batch(es)",
                         f"pass a multiple of {plan.dp_size * microbatches}")
    return Layout(backend=backend, options=options, plan=plan, microbatches=microbatches,
                  micro_batch=per_replica // microbatches,
                  schedule=schedule,
                  flags=_flags(backend, options, pp, tp, compression, schedule,
                               microbatches if pipeline is not None else None, accumulate),
                  comm=config.grad_comm)
