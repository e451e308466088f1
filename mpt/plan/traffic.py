"""What each backend sends per optimizer step over its data-parallel ranks, and what it can hide.

Written from the backends' code and from docs/benchmarks.md's bytes-on-the-wire measurements
(`make scaling`, 2 nodes: ddp, apex and horovod send 100.9 MB for 100.7 MB of gradients, the
ring's 2(N-1)/N; DeepSpeed's default ZeRO-1 1.5x, fsdp 2x on gloo):

- ddp, apex, horovod: one allreduce of the gradients, bucketed and started from backward hooks,
  so it may hide behind the rest of the backward. Under ``--pipeline-stages`` or
  ``--tensor-parallel`` mpt averages one flat bucket after the backward: nothing hidden.
- deepspeed ZeRO-0: the gradients' allreduce after the backward; ZeRO-1: the same, then an
  all-gather of the updated parameters; ZeRO-2: a reduce-scatter of the gradients and the
  all-gather; ZeRO-3: the parameters all-gathered for the forward and again for the backward,
  the gradients reduce-scattered. mpt leaves ``overlap_comm`` at DeepSpeed's default: off for
  stages 0-2, on for stage 3 (which then prefetches over the whole step).
- fsdp: each unit's parameters all-gathered in the forward and, resharded after it (the
  default, not under a pipeline), again in the backward; gradients reduce-scattered; all of it
  prefetched or overlapped over the whole step. Under a pipeline that once per schedule, or,
  with ``--fsdp-reshard-after-forward yes``, once per micro-batch (nothing is kept gathered
  between them). HSDP (``--fsdp-replicate R``) does this within
  each shard group and then allreduces the gradient shard across the R replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from mpt.parallel import Axis, ParallelPlan
from mpt.precision import PrecisionSpec

Kind = Literal["all_reduce", "all_gather", "reduce_scatter"]
Window = Literal["backward", "step", "none"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective of a step over the ranks of one mesh axis."""

    kind: Kind
    """What it does; its per-rank bytes follow the ring (2(N-1)/N or (N-1)/N x the size)."""
    axis: Axis
    """The mesh axis whose groups run it."""
    size: float
    """Bytes of the whole tensor (a rank's gradients, or the parameters it gathers)."""
    what: str
    """What moves, for people: ``gradients``, ``parameters``, ``gradient shard``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Traffic:
    """A backend's data-parallel collectives for one step, and what they may hide behind."""

    collectives: tuple[Collective, ...]
    """Every collective of one step, in order."""
    window: Window
    """Compute they may overlap: the backward, the whole step, or none."""
    shards_optimizer: bool
    """Whether each rank steps only its 1/dp_shard of the optimizer state."""


def stage_of(options: Mapping[str, Any]) -> int:
    """The ZeRO stage of DeepSpeed options (mpt's default where none is given)."""
    from mpt.backends.deepspeed_config import DEFAULT_STAGE

    stage = options.get("zero_stage")
    return DEFAULT_STAGE if stage is None else int(stage)


def traffic(backend: str, options: Mapping[str, Any], plan: ParallelPlan, spec: PrecisionSpec,
            parameters: float, microbatches: int = 1) -> Traffic:
    """What ``backend`` with ``options`` sends per step in ``plan`` for a rank that holds
    ``parameters`` parameters (its stage's, its tp share) trained in ``spec``, with
    ``microbatches`` per step under a pipeline."""
    grads = parameters * spec.reduce.itemsize
    weights = parameters * spec.params.itemsize
    if backend == "deepspeed":
        return _deepspeed(stage_of(options), parameters, spec)
    if backend == "fsdp":
        return _fsdp(options, plan, grads, weights, microbatches)
    window: Window = "none" if plan.model_size > 1 else "backward"
    return Traffic(collectives=(Collective(kind="all_reduce", axis="dp_replicate", size=grads,
                                           what="gradients"),),
                   window=window, shards_optimizer=False)


def _deepspeed(stage: int, parameters: float, spec: PrecisionSpec) -> Traffic:
    """DeepSpeed casts the model to its 16-bit mode's dtype and reduces in it."""
    from mpt.backends.deepspeed_config import mode_of

    width = 4 if mode_of(spec) is None else 2
    size = parameters * width
    axis: Axis = "dp_shard" if stage else "dp_replicate"
    gather = Collective(kind="all_gather", axis=axis, size=size, what="parameters")
    if stage == 0:
        found: tuple[Collective, ...] = (Collective(kind="all_reduce", axis=axis, size=size,
                                                    what="gradients"),)
    elif stage == 1:
        found = (Collective(kind="all_reduce", axis=axis, size=size, what="gradients"), gather)
    elif stage == 2:
        found = (Collective(kind="reduce_scatter", axis=axis, size=size, what="gradients"),
                 gather)
    else:
        found = (gather, gather, Collective(kind="reduce_scatter", axis=axis, size=size,
                                            what="gradients"))
    return Traffic(collectives=found, window="step" if stage == 3 else "none",
                   shards_optimizer=stage > 0)


def _fsdp(options: Mapping[str, Any], plan: ParallelPlan, grads: float, weights: float,
          microbatches: int) -> Traffic:
    """fully_shard: the gathers and the reduce-scatter within dp_shard, HSDP's allreduce of the
    shard across dp_replicate."""
    reshard = options.get("reshard_after_forward")
    if reshard is None:
        reshard = plan.pp == 1  # mpt's default: no under a pipeline
    # A pipeline that reshards runs fsdp's gathers and reduce-scatter for every micro-batch.
    times = microbatches if plan.pp > 1 and reshard else 1
    gather = Collective(kind="all_gather", axis="dp_shard", size=weights * times,
                        what="parameters")
    found = [gather, *([gather] if reshard else []),
             Collective(kind="reduce_scatter", axis="dp_shard", size=grads * times,
                        what="gradients")]
    if plan.dp_replicate > 1:
        found.append(Collective(kind="all_reduce", axis="dp_replicate",
                                size=grads / plan.dp_shard * times,
                                what="gradient shard"))
    return Traffic(collectives=tuple(found), window="step", shards_optimizer=True)
