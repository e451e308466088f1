"""DeepSpeed ZeRO (stages 0-3, CPU offload) behind mpt's backend interface.

The same script that runs under ``ddp`` runs here unchanged; the engine does what the precision
and the optimizer did there:

- ``rt.backward``: ``engine.backward`` (it divides by the accumulation steps and, in fp16, scales
  the loss). DeepSpeed counts micro-batches in ``engine.step()`` and reduces gradients on its own
  accumulation boundary, so off the boundary ``backward`` also calls ``engine.step()``, which there
  only advances the counter. At the boundary ``rt.step`` calls it and the update happens: one
  update per ``accumulate`` micro-batches, with the same averaged gradients as ``ddp``.
- ``rt.clip_grad_norm_(max_norm)``: ZeRO clips inside its step, where the sharded gradients are,
  with the same formula as ``torch.nn.utils.clip_grad_norm_``. The limit is handed to the engine
  for the coming step only, and the returned 0-dim tensor receives the norm DeepSpeed computed
  once ``rt.step()`` ran (NaN until then). Without ZeRO and in fp32 the gradients are plain
  ``.grad`` tensors, clipped at once as under ``ddp``.
- Checkpoints: full fp32 weights and per-parameter optimizer state, gathered from the shards by
  DeepSpeed's ``safe_get_full_*`` functions (collective: every rank calls), in mpt's by-name
  format, so a ZeRO checkpoint loads under any backend, stage and world size. At stage 3 a
  sharded checkpoint (the default there) gathers nothing: each rank writes and reads its own
  partitions (``safe_get_local_*``) as whole rows of each tensor, resharded at load.
"""

from __future__ import annotations

import bisect
import importlib.metadata
import itertools
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from mpt.backends.base import Availability, BackendOption, holds, wire_dtype
from mpt.backends.ddp import DDPBackend
from mpt.backends.deepspeed_config import (
    DEFAULT_STAGE,
    build_config,
    check_stage_and_offload,
    chosen_stage,
    comm_refusal,
    config_mode,
    load_user_config,
    mode_of,
    parse_offload,
    parse_stage,
    precision_refusal,
)
from mpt.backends.deepspeed_zero3 import share_fp32_partitions
from mpt.comm import GradComm
from mpt.environments import World
from mpt.errors import MissingDependencyError, UsageError
from mpt.estimate import Buffers, MemoryEstimate, parameter_counts
from mpt.parallel import Axis, ParallelPlan
from mpt.parallel.traffic import Collective, Traffic
from mpt.precision import LossScaleConfig, Precision, PrecisionSpec
from mpt.precision.base import dtype_name
from mpt.state.flat import FlatPiece
from mpt.state.named import from_named

if TYPE_CHECKING:  # it imports deepspeed, which is imported only once a run asks for it
    from mpt.backends.deepspeed_state import FlatState

INSTALL = 'pip install "deepspeed>=0.19,<0.20"'
OFFLOADED = ((1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "optimizer,parameters"))
"""Each ZeRO stage with what ``--offload`` may move to host memory there."""
ZERO_REDUCE_BUCKET = 5e8
"""DeepSpeed's default ``reduce_bucket_size``, in elements (``runtime/zero/config.py``)."""
ZERO3_MAX_LIVE = 1e9
"""DeepSpeed's default ``stage3_max_live_parameters``, in elements: how many a rank keeps
gathered at once."""
ZERO3_SUB_GROUP = 1e9
"""DeepSpeed's default ``sub_group_size``, in elements: ZeRO-3 steps the rank's partition
flattened in pieces of at most that many."""
ZERO3_MAX_REUSE = 1e9
"""DeepSpeed's default ``stage3_max_reuse_distance``, in elements: a parameter used again
within that many fetched is kept gathered."""


def partition_touches(model: nn.Module, ranks: int) -> int:
    """Elements of the parameters whose range a rank's ZeRO-2 partition overlaps, on the rank
    with the most: the parameters laid end to end (one parameter group, in the model's order,
    padded at the end to 2 x ranks elements), cut into ``ranks`` equal partitions
    (``stage_1_and_2.py``'s ``get_partition_info``). ZeRO-2 copies each such gradient whole
    into ``grads_in_partition`` and keeps it there until the step, and frees the others once
    reduced: on docs/benchmarks.md's MLP at 2 ranks 21.0 M of its 25.2 M parameters (its
    4096 x 4096 weight straddles both partitions), not the 12.6 M a partition holds."""
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    if ranks <= 1 or not sizes:
        return sum(sizes)
    starts = list(itertools.accumulate(sizes, initial=0))  # starts[i]: where sizes[i] begins
    part = -(-starts[-1] // (2 * ranks)) * 2  # the padded total over the ranks
    most = 0
    for rank in range(ranks):
        low, high = rank * part, (rank + 1) * part
        first = bisect.bisect_right(starts, low) - 1  # the one holding the partition's start
        last = bisect.bisect_left(starts, high)  # the first that starts at or past its end
        most = max(most, starts[min(last, len(sizes))] - starts[max(first, 0)])
    return most


def _import_deepspeed(device_type: str, local_rank: int | None = None) -> Any:
    """Import DeepSpeed for ``device_type``, or raise MissingDependencyError.

    DeepSpeed reads two variables that mpt knows better, so they are exported here, where
    DeepSpeed starts, and nowhere else (a value the user set wins):

    - ``DS_ACCELERATOR``: DeepSpeed picks its accelerator once, at import, from it or by probing.
      mpt has already chosen the device; on CPU probing also ends on CPU, but only after a
      warning on every rank.
    - ``LOCAL_RANK``: ``deepspeed.initialize`` refuses to run without it, and neither SLURM,
      mpirun nor a plain ``python train.py`` sets it; mpt's ``World`` has it for all of them.
    """
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    try:
        import deepspeed
    except Exception as exc:  # ImportError, or a broken install failing at import time
        raise MissingDependencyError("backend 'deepspeed'", "deepspeed", INSTALL,
                                     reason=f"{type(exc).__name__}: {exc}") from exc
    return deepspeed


def _installed_version() -> str | None:
    """DeepSpeed's version if it is installed (cheap: reads package metadata, imports nothing)."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(kw_only=True, slots=True, eq=False)
class _Engine:
    """One DeepSpeed engine (one per model set up with an optimizer) and mpt's notes on it."""

    engine: Any
    """What ``deepspeed.initialize`` returned, and ``setup`` hands to the script."""
    state: FlatState
    """Its parameters by name, and their state in ZeRO's flat shards (for checkpoints)."""

    default_clip: float = 0.0
    """The config's ``gradient_clipping``, restored after a step ``rt.clip_grad_norm_`` set."""
    norm: torch.Tensor | None = None
    """What ``rt.clip_grad_norm_`` returned: filled with DeepSpeed's norm after the step."""
    backwards: int = 0
    """Losses this engine backpropagated since its last ``step``."""
    push_scale: bool = False
    """A checkpoint was loaded: its loss scale goes into the engine at the next backward."""


class DeepSpeedBackend(DDPBackend):
    """ZeRO data parallelism: optimizer state (1), gradients (2) and parameters (3) sharded.

    Process-group plumbing and the script-facing collectives are DDP's (DeepSpeed adopts a group
    that already exists); everything about the model and the optimizer goes through the engine.
    """

    name = "deepspeed"
    pipelines: ClassVar[bool] = False
    tensor_parallel: ClassVar[bool] = False
    options: ClassVar[dict[str, BackendOption]] = {
        "zero_stage": BackendOption(help="ZeRO stage 0, 1, 2 or 3 (default: the config's, "
                                    "else 1)", parse=lambda _, v: parse_stage(v),
                                    flag="--zero-stage"),
        "offload": BackendOption(help="none, optimizer, parameters (stage 3) or "
                                 "optimizer,parameters, moved to CPU memory",
                                 parse=lambda _, v: parse_offload(v), default=frozenset(),
                                 flag="--offload"),
        "config": BackendOption(help="DeepSpeed JSON config (a path, or a dict from code); the "
                                "flags fill only what it leaves out",
                                parse=lambda _, v: load_user_config(v), default={},
                                flag="--deepspeed-config"),
    }

    def __init__(self, *, world: World, device: torch.device, precision: Precision,
                 accumulate: int = 1, timeout: timedelta = timedelta(minutes=30),
                 options: Mapping[str, Any] | None = None, comm: GradComm | None = None,
                 layout: ParallelPlan | None = None) -> None:
        super().__init__(world=world, device=device, precision=precision, accumulate=accumulate,
                         timeout=timeout, options=options, comm=comm, layout=layout)
        values = self.option_values
        scale = getattr(precision, "scaling", None) or LossScaleConfig()
        self.config: dict[str, Any] = build_config(
            values["config"], stage=values["zero_stage"],
            offload=values["offload"], mode=mode_of(precision.spec),
            loss_scale=scale, accumulate=accumulate, world_size=world.world_size,
            comm=self.comm)
        """What ``deepspeed.initialize`` gets: the user's config, completed by mpt."""
        self.stage_chosen = chosen_stage(values["config"], values["zero_stage"]) is not None
        """Whether ``--zero-stage`` or the config chose the stage (else DEFAULT_STAGE)."""
        self._ds = _import_deepspeed(device.type, world.local_rank)  # before any process group
        self._engines: dict[int, _Engine] = {}
        """One engine per model set up with an optimizer, by id of the engine."""
        self._pending: list[tuple[_Engine | None, torch.Tensor]] = []
        """Losses not backpropagated yet, with their engine where ``model=`` named it."""

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """Every check that needs no process: run by `mpt launch` before it starts any."""
        values = super().check_options(options)
        if _installed_version() is None:  # `mpt launch` says so once, instead of every rank
            raise MissingDependencyError("backend 'deepspeed'", "deepspeed", INSTALL,
                                         reason="it is not installed")
        check_stage_and_offload(values["config"], values["zero_stage"], values["offload"])
        return values

    @classmethod
    def comm_refusal(cls, comm: GradComm, values: Mapping[str, Any]
                     ) -> tuple[str, Any, str, str] | None:
        stage = check_stage_and_offload(values["config"], values["zero_stage"], values["offload"])
        return comm_refusal(values["config"], stage, comm)

    @classmethod
    def precision_refusal(cls, spec: PrecisionSpec, device_type: str,
                          options: Mapping[str, Any]) -> tuple[str, str] | None:
        """DeepSpeed trains fp32 and, through its own fp16/bf16 modes (model cast, fp32 masters
        in the engine), the autocast precisions; see ``deepspeed_config.precision_refusal``."""
        return precision_refusal(load_user_config(options.get("config")), spec, device_type)

    @classmethod
    def estimate_memory(cls, model: nn.Module, spec: PrecisionSpec, optimizer_states: int,
                        world_size: int, options: Mapping[str, Any]) -> list[MemoryEstimate]:
        """Weights and gradients in the mode's dtype; the optimizer's state plus DeepSpeed's
        fp32 master copy (kept from stage 1 on even in fp32, and in 16-bit modes at stage 0);
        stage 1 partitions the optimizer's share, 2 the gradients too, 3 the weights too.
        Stage 2 keeps each gradient its partition touches whole (``partition_touches``).
        Offloaded, that state is in host memory, beside the buffers DeepSpeed makes there:
        the partition's fp32 gradients, and at stages 1-2 a buffer of the update in the
        mode's dtype and one of the largest gradient (``stage_1_and_2.py``; ``stage3.py``'s
        ``subgroup_gradient_buffer``)."""
        width = cls._width(spec)
        weights, trained = parameter_counts(model)
        largest = max((p.numel() for p in model.parameters() if p.requires_grad), default=0)
        rows = []
        for stage, offload in ((0, ""), (1, ""), (2, ""), (3, ""), *OFFLOADED):
            masters = 4 * trained if stage > 0 or width == 2 else 0
            parts = [width * weights, width * trained, 4 * optimizer_states * trained + masters]
            for index in range(3 - stage, 3):
                parts[index] //= world_size  # optimizer from stage 1, gradients 2, weights 3
            if stage == 2 and not offload:
                parts[1] = width * partition_touches(model, world_size)
            host = 0
            if "optimizer" in offload:
                host, parts[2] = parts[2], 0
                host += 4 * trained // world_size + (
                    width * (trained // world_size + largest) if stage < 3 else 0)
            if "parameters" in offload:
                host, parts[0] = host + parts[0], 0
            rows.append(MemoryEstimate(label=cls._label(stage, offload), parameters=parts[0],
                                       gradients=parts[1], optimizer=parts[2], host=host))
        return rows

    @staticmethod
    def _width(spec: PrecisionSpec) -> int:
        """Bytes of a weight, a gradient and what is sent: DeepSpeed casts the model to its
        16-bit mode's dtype and reduces in it, else fp32."""
        return 4 if mode_of(spec) is None else 2

    @staticmethod
    def _label(stage: int, offload: str = "") -> str:
        """An ``estimate_memory`` row's label: the flags that choose it."""
        return f"deepspeed --zero-stage {stage}" + (f" --offload {offload}" if offload else "")

    @staticmethod
    def _planned_offload(options: Mapping[str, Any]) -> str:
        """What ``options`` offload, as ``--offload`` writes it ("" for nothing)."""
        return ",".join(sorted(parse_offload(options.get("offload") or "none")))

    @staticmethod
    def _planned_stage(options: Mapping[str, Any]) -> int:
        """The ZeRO stage ``options`` name, mpt's default where none (`mpt plan` names it
        itself: a config's stage is not read)."""
        stage = options.get("zero_stage")
        return DEFAULT_STAGE if stage is None else int(stage)

    @classmethod
    def estimate_row(cls, rows: Sequence[MemoryEstimate], options: Mapping[str, Any]
                     ) -> MemoryEstimate:
        """The row of the options' ZeRO stage and offload."""
        wanted = cls._label(cls._planned_stage(options), cls._planned_offload(options))
        return next((r for r in rows if r.label == wanted), rows[0])

    @classmethod
    def estimate_buffers(cls, stage: nn.Module, spec: PrecisionSpec, row: MemoryEstimate,
                         share: float, plan: ParallelPlan, options: Mapping[str, Any],
                         comm: GradComm | None = None, microbatches: int = 1) -> Buffers:
        """ZeRO-1 and 2: after the backward (in its epilogue, as the activations are let go),
        the reduction bucket (``_zero_buffers``), the partition's gradients flattened in fp32
        for the optimizer (``single_grad_partition``: measured at the optimizer's step, 48
        MiB above the resting set for the MLP's 12.6 M a rank, in fp32 and in bf16 alike),
        and at ZeRO-2 under ``--accumulate`` the reduced partition copied out of the bucket
        beside the one it is added to; the flat partition is kept through the step, whose
        own copies (the partition's gradients in fp64 for the norm) take its place. Before the
        optimizer steps, the bucket is let go (``_release_ipg_buffers``) and so are the
        model's gradients (``free_grad_in_param_list``): measured at the optimizer's
        pre-hook, the parameters, the optimizer's state and the flat partition remain. With
        an offloaded optimizer, its buffers are counted from the backward on, with a buffer
        of the largest gradient (``temp_grad_buffer_for_gpu_offload``).

        ZeRO-3 (DeepSpeed 0.19's ``stage3.py`` at its defaults): every parameter gathered whole
        from the forward through the backward (``stage3_max_live_parameters`` and
        ``stage3_max_reuse_distance``, 1e9 elements each, keep them), the contiguous
        gradients' bucket (``reduce_bucket_size``, 5e8 elements, empty until written: as far
        as the gradients reach) and the copy of it that ``reduce_scatter_coalesced``
        concatenates to reduce-scatter, at the backward's end (traced at each module's
        backward: the peak comes after the last one's; an autograd gradient is copied into
        the bucket and let go before the next, so none lies beside the full bucket). All but
        the bucket are freed before the step, which flattens the partition's gradients anew
        in fp32 (``_prepare_fp32_grad_for_sub_group``) and keeps that through the
        optimizer's step (``Buffers.stepping``).

        ZeRO-0: none modelled (DDP's buckets, which this class would inherit, are not
        DeepSpeed's)."""
        zero = cls._planned_stage(options)
        trained = [share * p.numel() for p in stage.parameters() if p.requires_grad]
        if zero in (1, 2):
            bucket, _ = cls._zero_buffers(spec, sum(trained), plan.dp_shard)
            flat = 4 * sum(trained) / plan.dp_shard
            if cls._planned_offload(options):  # and a buffer of the largest gradient
                staged = cls._width(spec) * max(trained, default=0)
                return Buffers(held=int(bucket + flat + staged),
                               released=int(bucket + row.gradients))
            # ZeRO-2 accumulating adds each micro-batch's reduced partition to the one kept
            added = row.gradients if zero == 2 and microbatches > 1 else 0
            return Buffers(between=int(bucket + flat + added), stepping=int(flat),
                           released=row.gradients)
        if zero == 3:
            width = cls._width(spec)
            gathered = width * min(share * parameter_counts(stage)[0], ZERO3_MAX_LIVE)
            bucket = width * min(sum(trained), ZERO_REDUCE_BUCKET)
            return Buffers(held=int(gathered + 2 * bucket), released=int(gathered + bucket),
                           stepping=int(4 * min(sum(trained) / plan.dp_shard,
                                                ZERO3_SUB_GROUP)))
        return Buffers()

    @classmethod
    def _zero_buffers(cls, spec: PrecisionSpec, parameters: float, shards: int
                      ) -> tuple[float, float]:
        """Bytes of ZeRO-1/2's reduction bucket, into which every gradient is copied, and of
        the rank's partition of the reduced gradients copied out of it, for a rank that
        trains ``parameters`` split ``shards`` ways: both in the mode's dtype
        (``_gradient_reduction_buffer_dtype``: DeepSpeed's ``grad_accum_dtype``, which mpt
        leaves at the model's; seen: the bucket in bf16 under bf16 at ZeRO-1 and 2 alike)."""
        return parameters * cls._width(spec), parameters * cls._width(spec) / shards

    @classmethod
    def accumulation_priced(cls, options: Mapping[str, Any]) -> bool:
        """Every stage that keeps its optimizer on the device: ZeRO-0 and 1 reduce at the
        accumulation boundary, once a step; ZeRO-2 at every micro-batch
        (``reduce_ready_partitions_and_remove_grads``), keeping its partition's gradients
        between them in the buffer the row counts; ZeRO-3 gathers and reduce-scatters at
        every one (``step_traffic``). Not an offloaded optimizer's: DeepSpeed accumulates its
        gradients on the host (``async_accumulate_grad_in_cpu_via_gpu``), not modelled."""
        return not cls._planned_offload(options)

    @classmethod
    def timed_alone(cls) -> tuple[Mapping[str, Any], ...]:
        """ZeRO-3: its hooks around every module fetch, prefetch and release parameters and
        partition gradients in each micro-batch, work in Python that no collective or copy
        prices (measured at one rank on 8 Linear(1024, 1024): ZeRO-3 accumulating 4
        micro-batches took 453 ms a step against ZeRO-2's 332, about 30 ms a micro-batch
        beyond its copies). ZeRO 0-2 step as priced (0.92-0.99 of their measured steps)."""
        return ({"zero_stage": 3},)

    @classmethod
    def fresh_gradient_in_row(cls, options: Mapping[str, Any]) -> bool:
        """ZeRO-3 reduce-scatters each gradient as the backward makes it and frees it: none
        is held for autograd to add the next micro-batch's to."""
        return cls._planned_stage(options) == 3

    @classmethod
    def plan_variants(cls, world_size: int, pp: int) -> list[dict[str, Any]]:
        """Every ZeRO stage, and each with what it may offload (``OFFLOADED``)."""
        return [*({"zero_stage": stage} for stage in range(4)),
                *({"zero_stage": stage, "offload": offload} for stage, offload in OFFLOADED)]

    @classmethod
    def step_traffic(cls, options: Mapping[str, Any], plan: ParallelPlan, spec: PrecisionSpec,
                     parameters: float, microbatches: int = 1,
                     module: torch.nn.Module | None = None, comm: GradComm | None = None
                     ) -> Traffic:
        """In the mode's dtype (``_width``): ZeRO-0 the gradients' allreduce after the
        backward; ZeRO-1 and 2 the same, then an all-gather of the updated parameters (both
        allreduce the whole bucket, DeepSpeed's default ``use_multi_rank_bucket_allreduce``:
        measured, 100.7 MB allreduced per step at 2 ranks under either); ZeRO-3 the
        parameters all-gathered for the forward, the gradients reduce-scattered. ZeRO-3 keeps
        a gathered parameter for the backward where it is used again within
        ``stage3_max_reuse_distance`` elements fetched (DeepSpeed's default
        ``ZERO3_MAX_REUSE``): counted here, the backward gathers again only what the forward
        fetched more than half that before the end (traced at 2 ranks on 8 Linear(1024,
        1024): one gather of the 8.4 M parameters a micro-batch, not two). mpt leaves
        ``overlap_comm`` at DeepSpeed's default: off for stages 0-2, on for stage 3 (which
        then prefetches over the whole step).

        Around them ZeRO-1 and 2 (DeepSpeed 0.19's ``stage_1_and_2.py``, contiguous gradients
        as by default) allocate anew at every step: the reduction bucket, into which every
        gradient is copied (in the mode's dtype; ``reduce_bucket_size``
        elements, of which the gradients' are written), the rank's partition of the reduced
        gradients copied out of it, each of that partition's gradients in fp64 for the norm
        (``get_norm_dtype``), and the partition flattened for the optimizer. ``average_tensor``
        divides the whole bucket in place by the ranks; over N > 1 ranks it gathers the
        bucket's slices into one new flat tensor to allreduce
        (``allreduce_and_copy_with_multiple_ranks``) and copies the rank's own slices back.
        The norm reads the fp64 copies again, and the step copies the updated fp32 partition
        into the model's parameters. The copies are ``Traffic.copies``. (What gloo does
        inside the all-gather, into a flat tensor of its own, is in the calibrated sweep's
        time of that collective.) ZeRO-0 (the engine's ``allreduce_bucket``, traced): the
        gradients flattened, over N > 1 ranks divided in place, cast to the dtype sent and
        back where it differs, and copied back into each gradient.

        ZeRO-3 (``stage3.py``, traced at one rank; for the MLP's 25.2 M parameters ``copy_``
        alone writes 151 M elements a step): ``reduce_scatter_coalesced`` concatenates every
        gradient into one flat tensor and divides it in place; ``partition_grads`` copies the
        rank's shard into its fp32 partition, which the norm casts to fp64 and reads and
        ``unscale_and_clip_grads`` multiplies in place; in a 16-bit mode the update is copied
        into the weights (in fp32 mpt keeps one fp32 copy of each partition: nothing to
        copy). At one rank each all-gather and the reduce-scatter is one copy of the whole,
        which no collective prices there; over more (``partition_parameters.py``'s coalesced
        all-gather) each gather copies the ranks' shards into its flat input (``torch.cat``
        ``out=``) and each parameter out of it whole (``torch.cat`` of its pieces, which lie
        rank by rank): profiled at 2 ranks, 10 such calls a micro-batch where one rank makes 1,
        10 ms more a micro-batch on 8 Linear(1024, 1024).

        A cast ``--grad-compression`` is DeepSpeed's ``communication_data_type``: the gradients
        are reduced in it, the parameters gathered as they are. Where the dtype sent is not
        the bucket's, ``allreduce_bucket``
        casts the flat tensor to it and the result back (ZeRO-3 not modelled so).

        Under ``--accumulate`` ZeRO-0 and 1 reduce once, at the boundary; ZeRO-2 reduces the
        bucket in every micro-batch and copies the partition's gradients out of it; ZeRO-3
        gathers, reduce-scatters and adds into the fp32 partition in every one; the norm, the
        update and the gather of the updated parameters stay once a step.

        ``--offload optimizer`` steps the partition on the host: its reduced gradients go to
        the host's fp32 copy of it (torch's ``copy_`` converts before it moves, so they cross
        in fp32), and the updated partition comes back into the weights in the mode's dtype,
        through a host buffer of that dtype (``param_buffer_of_bit16_for_cpu_offload_groups``):
        buffers of DeepSpeed's own, copied into on a CPU too (``Traffic.host_buffers``).
        ``--offload parameters`` (ZeRO-3) keeps the partition of the weights on the host too:
        each gather first fetches it, and the update stays there (``Traffic.host_copies``).

        ZeRO 1-3 step the rank's partition as flat fp32 tensors of their own
        (``single_partition_of_fp32_groups``, one a parameter group; ZeRO-3's
        ``fp32_partitioned_groups_flat``, in pieces of ``sub_group_size``): the optimizer's
        temporaries are of a whole one (``Traffic.flat_step``; measured, 2 x 4 bytes of the
        partition in torch's Adam on a CPU)."""
        stage = cls._planned_stage(options)
        width = cls._width(spec)
        size = parameters * width
        mode = torch.float32 if width == 4 else spec.compute
        sent = wire_dtype(comm, mode)
        axis: Axis = "dp_shard" if stage else "dp_replicate"
        # ZeRO-2 reduces, and ZeRO-3 gathers and reduces, in every accumulated micro-batch
        each = microbatches if stage >= 2 else 1
        gather = Collective(kind="all_gather", axis=axis, size=size, what="parameters")
        gradients = Collective(kind="reduce_scatter" if stage == 3 else "all_reduce", axis=axis,
                               size=parameters * sent.itemsize * each, what="gradients",
                               dtype=dtype_name(sent), calls=each)
        found: tuple[Collective, ...] = (gradients,) if stage == 0 else (gradients, gather)
        if stage == 3:  # the forward's gathers, the backward's of what was let go
            again = max(0.0, parameters - ZERO3_MAX_REUSE / 2) * width
            found = (replace(gather, size=size * each, calls=each),
                     *([replace(gather, size=again * each, calls=each)] if again else []),
                     gradients)
        ranks = plan.dp_shard
        mine = parameters / ranks  # the rank's partition
        cast = mine * (4 + width) / 2  # the partition between fp32 and the mode's dtype
        norm = mine * (width + 2 * 8) / 2  # the partition to fp64, and read for the norm
        copies = 0.0
        if stage == 0:
            copies = size * (2 + (plan.dp_replicate > 1))  # flattened, divided, back
            if sent != mode:
                copies += size + parameters * sent.itemsize  # cast there and back
        if stage == 3:
            copies = (each * (2 * size + cast)  # concatenated, divided; into the fp32 partition
                      + norm + 4 * mine  # the norm; unscaled
                      + (cast if width != 4 else 0))  # the update back
            if ranks == 1:
                copies += 3 * size * each  # the two all-gathers and the reduce-scatter
            else:  # each gather's shards into its flat input, and every parameter out of it
                copies += (1 + 1 / ranks) * sum(c.size for c in found if c.kind == "all_gather")
        if stage in (1, 2):
            bucket, partition = cls._zero_buffers(spec, parameters, ranks)
            reduced = 2 * bucket + partition  # in, divided; out
            if ranks > 1:
                reduced += bucket + bucket / ranks  # the slices flattened, its own copied back
                if sent != mode:  # cast there and back
                    reduced += bucket + parameters * sent.itemsize
            copies = (each * reduced + partition  # flattened for the optimizer
                      + norm + cast)  # the fp32 partition into the weights
        offload = cls._planned_offload(options)
        # its gradients to the host in fp32; back, the update, or with the weights kept
        # there the rank's part of each gather, fetched first, instead
        back = (sum(c.size for c in found if c.kind == "all_gather") / ranks
                if "parameters" in offload else mine * width)
        return Traffic(collectives=found, window="step" if stage == 3 else "none",
                       shards_optimizer=stage > 0, copies=copies,
                       host_copies=4 * mine + back if offload else 0.0,
                       host_buffers=True, steps_on_host=bool(offload),
                       flat_step=None if stage == 0 else ZERO3_SUB_GROUP if stage == 3
                       else math.inf)

    @classmethod
    def default_precision(cls, options: Mapping[str, Any]) -> str | None:
        """A config that enables fp16 or bf16 asks for fp16-mixed or bf16-mixed."""
        mode = config_mode(load_user_config(options.get("config")))
        return None if mode is None else f"{mode}-mixed"

    @classmethod
    def data_axis(cls, options: Mapping[str, Any]) -> Axis:
        """ZeRO 1-3 split the state over the ranks; stage 0 replicates it."""
        values = cls.check_options(options)
        stage = check_stage_and_offload(values["config"], values["zero_stage"], values["offload"])
        return "dp_shard" if stage else "dp_replicate"

    @classmethod
    def default_batch_size(cls, options: Mapping[str, Any], accumulate: int,
                           dp_size: int) -> int | None:
        """``train_micro_batch_size_per_gpu``, or ``train_batch_size`` over the accumulation
        steps and the replicas: what ``engine.train_micro_batch_size_per_gpu()`` returns."""
        config = load_user_config(options.get("config"))
        micro, total = config.get("train_micro_batch_size_per_gpu"), config.get("train_batch_size")
        if micro is None and total is not None:
            steps = int(config.get("gradient_accumulation_steps", accumulate))
            micro = int(total) // (steps * dp_size) or None
        return None if micro is None else int(micro)

    @classmethod
    def availability(cls) -> Availability:
        version = _installed_version()
        if version is None:
            return Availability(available=False, reason="deepspeed is not installed",
                                install=INSTALL)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            _import_deepspeed(device)
        except MissingDependencyError as exc:
            cause = exc.__cause__
            return Availability(available=False, version=version, install=INSTALL,
                                reason=f"import deepspeed failed: {type(cause).__name__}: {cause}")
        return Availability(available=True, version=f"{version} ({device})")

    # -- life cycle ---------------------------------------------------------------------------
    group_alone = True  # DeepSpeed needs a process group even for one process

    def init_process_group(self) -> None:
        super().init_process_group()
        if self.world.is_distributed:
            # ZeRO reduces over DeepSpeed's clone of the world group, which it makes without a
            # timeout (torch's 30 min): made here first, with --timeout, a hung peer fails.
            groups = importlib.import_module("deepspeed.utils.groups")
            groups._WORLD_GROUP = groups._WORLD_GROUP or dist.new_group(timeout=self.timeout)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        from mpt.backends.deepspeed_state import FlatState

        if optimizer is None:  # nothing to train: no engine, rank 0's weights everywhere
            self.broadcast_module_(model)
            return model, None
        stage = self.config["zero_optimization"]["stage"]
        if self._engines and stage != 1:
            # Stage 0 refuses a backward that reaches a second engine's module (a GAN's
            # discriminator inside the generator's loss); stages 2-3 reduce a model's gradients
            # into its shards inside any backward that reaches it, where the script's zero_grad
            # cannot clear them: they would join that model's next step.
            raise UsageError("--zero-stage", stage, "DeepSpeed keeps a model's gradients "
                             "apart only at stage 1 when a script trains several models",
                             "use --zero-stage 1, or --backend ddp, apex or horovod")
        if len(self._engines) == 1 and not self.stage_chosen and self.world.rank == 0:
            print(f"mpt: deepspeed trains several models at ZeRO stage {stage}, taken because "
                  "no --zero-stage was given: the stage that keeps their gradients apart",
                  file=sys.stderr, flush=True)
        names = {param: name for name, param in model.named_parameters()}
        # DeepSpeed drops empty groups and replaces the parameters of the others by flat shards:
        # remember each group's names now, for checkpoints keyed by name.
        groups = [[names[p] for p in g["params"]] for g in optimizer.param_groups if g["params"]]
        engine, _, _, _ = self._ds.initialize(model=model, optimizer=optimizer,
                                              config=self.config, dist_init_required=False)
        if stage == 3:  # one fp32 copy of each partition, as DeepSpeed means (see the module)
            share_fp32_partitions(engine.optimizer)
        self._engines[id(engine)] = _Engine(
            engine=engine, state=FlatState(engine, groups),
            default_clip=float(getattr(engine.optimizer, "clip_grad", 0.0) or 0.0))
        # The user's optimizer, not DeepSpeed's wrapper: the wrapper steps it and shares its
        # param-group dicts, so an LR scheduler built on what setup returns works (torch's
        # schedulers refuse DeepSpeed's ZeRO optimizers, which are no torch Optimizer). Its
        # zero_grad must reach the gradients the engine keeps in the module (stages 0-1) until
        # its backward reduces them: there another model's loss may have left some.
        clear_own = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            engine.zero_grad()
            clear_own(set_to_none=set_to_none)

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        return engine, optimizer

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing left to do: ``optimizer_step`` cleared the engine's gradients."""

    def _of(self, model: nn.Module) -> _Engine:
        found = self._engines.get(id(model))
        if found is None:
            raise RuntimeError("call rt.setup(model, optimizer) before training with deepspeed")
        return found

    # -- the training step --------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: nn.Module | None = None) -> None:
        # Run at the next step or clip, as one backward of the sum of the losses given since
        # the last one: DeepSpeed reduces at the end of each engine.backward on the
        # accumulation boundary, so two backwards before one step (a discriminator's real and
        # fake losses) would keep only the second. With several engines, the one a loss trains
        # is also known only then (a generator's loss runs through the discriminator too).
        self._pending.append((None if model is None else self._of(model), loss))

    def _flush(self, model: nn.Module, method: str) -> _Engine:
        """The engine of ``model``, after it ran the backward of the losses waiting for it."""
        record = self._of(model)
        mine = [loss for owner, loss in self._pending if owner in (None, record)]
        self._pending = [(owner, loss) for owner, loss in self._pending
                         if owner not in (None, record)]
        if not mine and not record.backwards:
            raise UsageError(f"rt.{method}", "optimizer", "no loss went through this model's "
                             "DeepSpeed engine since its last step (with several engines, a "
                             "loss trains the model whose optimizer steps next)", "pass "
                             "rt.backward(loss, model=...) once per model a loss trains, or "
                             "step each optimizer right after the backward of its own losses")
        if mine:
            engine = record.engine
            if record.push_scale:  # a checkpoint was loaded: its loss scale goes in first
                record.push_scale = False
                from mpt.backends.deepspeed_state import apply_scaler_state, loss_scaler_of

                state = self.precision.loss_scale_state
                loss_scaler = loss_scaler_of(engine.optimizer)
                if state is not None and loss_scaler is not None:
                    apply_scaler_state(loss_scaler, state)
            total = mine[0]
            for loss in mine[1:]:
                total = total + loss
            engine.backward(total)
            record.backwards += 1
        return record

    def accumulate_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # Off the accumulation boundary engine.step() only counts the micro-batch: DeepSpeed
        # reduces on its own boundary, which is therefore the same as mpt's.
        record = self._flush(model, "step")
        record.engine.step()
        record.backwards = 0

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """Nothing to do: the engine knows its accumulation boundary from its own counter."""

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        record = self._flush(model, "clip_grad_norm_")
        engine = record.engine
        if norm_type != 2.0:
            raise UsageError("norm_type", norm_type, "DeepSpeed clips by the 2-norm only",
                             "call rt.clip_grad_norm_(max_norm) with the default norm_type=2")
        if engine.optimizer is engine.basic_optimizer:  # stage 0, fp32: plain averaged .grad
            params = [p for p in engine.module.parameters() if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        if not hasattr(engine.optimizer, "clip_grad"):
            raise UsageError("rt.clip_grad_norm_", max_norm, f"DeepSpeed's "
                             f"{type(engine.optimizer).__name__} has no clipping limit mpt can "
                             "set per step", 'set "gradient_clipping" in the DeepSpeed config')
        engine.optimizer.clip_grad = float(max_norm)  # for the coming step only
        record.norm = torch.full((), float("nan"))
        return record.norm

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        record = self._flush(model, "step")
        engine = record.engine
        engine.step()
        record.backwards = 0
        # The gradients live in DeepSpeed's wrapper (flat, partitioned), not in `optimizer`.
        engine.optimizer.zero_grad(set_to_none=True)
        if record.norm is not None:
            norm = engine.get_global_grad_norm()
            record.norm.fill_(float("nan") if norm is None else float(norm))
            record.norm = None
            engine.optimizer.clip_grad = record.default_clip
        applied = bool(engine.was_step_applied())
        self.precision.skipped_steps += int(not applied)
        if self.precision.loss_scale_state is not None:
            # mpt's checkpoint stores the precision's scaler: keep it equal to DeepSpeed's.
            from mpt.backends.deepspeed_state import loss_scaler_of, scaler_state

            loss_scaler = loss_scaler_of(engine.optimizer)
            if loss_scaler is not None:
                self.precision.loss_scale_state = scaler_state(loss_scaler)
        return applied

    # -- state for checkpoints ----------------------------------------------------------------
    def update_loss_scale(self) -> None:
        """Nothing to do: each engine updates its own loss scale in its step."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if id(model) in self._engines else model

    @property
    def shards_state(self) -> bool:  # type: ignore[override]
        """At stage 3 each rank holds its partition of every parameter and its state."""
        return bool(self._engines) and self.config["zero_optimization"]["stage"] == 3

    def local_model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        if id(model) not in self._engines or not self.shards_state:
            return super().local_model_state_dict(model)
        return self._of(model).state.local_weights(self.device)

    def local_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                   *, create: bool = False) -> dict[str, Any]:
        if not self.shards_state:
            return super().local_optimizer_state_dict(model, optimizer, create=create)
        return self._of(model).state.local_optimizer_state(self.device, create=create)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if id(model) not in self._engines:
            return super().model_state_dict(model)
        engine = self._of(model).engine
        state = engine.module.state_dict()
        for name, param in engine.module.named_parameters():
            full = self._ds.utils.safe_get_full_fp32_param(param)  # collective
            state[name] = (param.detach() if full is None else full).clone()
        return state

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if id(model) not in self._engines:
            super().load_model_state_dict(model, state)
            return
        record = self._of(model)
        if holds(FlatPiece, state):  # read in place into this rank's partitions
            record.state.load_local_weights(state)
            return
        module = record.engine.module
        wanted = set(module.state_dict())
        if set(state) != wanted:
            missing, unknown = sorted(wanted - set(state)), sorted(set(state) - wanted)
            raise UsageError("checkpoint", ", ".join((missing or unknown)[:3]),
                             "the checkpoint's weights do not match the model's "
                             f"({'missing' if missing else 'unknown'} names)",
                             "load it into the model it was saved from")
        record.state.load_weights({n: t.to(self.device) for n, t in state.items()})

    def optimizer_state_dict(self, model: nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        record = self._of(model)
        if record.engine.optimizer is record.engine.basic_optimizer:
            return super().optimizer_state_dict(model, optimizer)
        return record.state.optimizer_state()

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        record = self._of(model)
        # Runtime.load restores the precision (loss scale) right after this: the engine takes
        # it over at the next backward.
        record.push_scale = True
        if record.engine.optimizer is record.engine.basic_optimizer:
            super().load_optimizer_state_dict(model, optimizer, state)
            return
        from_named(state, record.state.names)  # refuses checkpoints of other models
        record.state.load_optimizer_state(state)
