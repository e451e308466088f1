"""torch's fully sharded data parallel, FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank keeps 1/N of every parameter, gradient and optimizer state as a ``DTensor`` shard;
a sharded module all-gathers its parameters just before its forward (and again for its backward)
and reduce-scatters the gradients after it. The process group and the collectives offered to
scripts are DDP's. ``--grad-compression fp16|bf16`` is the reduce dtype of every unit's
``MixedPrecisionPolicy``; PowerSGD and ``--bucket-mb`` are refused: fully_shard has no comm hook
for the one, and reduces each unit's gradients in one collective instead of buckets.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mpt.backends.base import CAST_DTYPES, Availability, BackendOption, on_meta, wire_dtype
from mpt.backends.ddp import DDPBackend
from mpt.backends.meta import check_materialisable, materialise, rank0_random_state
from mpt.comm import GradComm
from mpt.errors import UsageError
from mpt.estimate import Buffers, MemoryEstimate, parameter_counts
from mpt.parallel import Axis, ParallelPlan, divisors
from mpt.parallel.traffic import Collective, Traffic
from mpt.parse import parse_bool, parse_int, parse_text
from mpt.precision import PrecisionSpec
from mpt.precision.base import dtype_name

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MIN_UNIT_PARAMETERS = 1_000_000
"""Without ``--fsdp-wrap``, a submodule holding at least this many parameters that no smaller
unit took becomes its own unit (FSDP1's size-based policy): one unit's parameters are gathered
at a time, so peak memory is the shards plus the largest unit, not the whole model."""


def parse_count(argument: str, value: Any) -> int:
    """A whole number of at least 1."""
    count = parse_int(argument, value)
    if count < 1:
        raise UsageError(argument, count, "it must be at least 1", f"pass {argument} 1 or more")
    return count


def parse_class_names(argument: str, value: Any) -> frozenset[str]:
    """Module class names, comma-separated (``Block,Embedding``) or as a list from code."""
    names = value.split(",") if isinstance(value, str) else list(value)
    cleaned = frozenset(parse_text(argument, name).strip() for name in names)
    if not all(cleaned):
        raise UsageError(argument, value, "an empty class name",
                         "pass module class names separated by commas, e.g. Block")
    return cleaned


CONTAINERS = (nn.ModuleList, nn.ModuleDict)
"""Modules without a forward of their own, which fully_shard refuses: never a unit (FSDP1's
size-based policy skipped them too); their parameters count towards the module above."""


def units(model: nn.Module, wrap: frozenset[str] | None) -> list[nn.Module]:
    """The submodules sharded apart from the root, innermost first (fully_shard's order): those
    of the classes ``wrap`` names, else each that holds ``MIN_UNIT_PARAMETERS`` no unit below
    it took; never a container (``CONTAINERS``)."""
    found, taken = [], set()

    def visit(module: nn.Module) -> int:
        """Parameters under ``module`` that no unit below it took; children first, in order
        (fully_shard's order, and the order in which a meta model's units are initialised)."""
        free = sum(visit(child) for child in module.children())
        free += sum(p.numel() for p in module.parameters(recurse=False) if id(p) not in taken)
        if module is not model and not isinstance(module, CONTAINERS) and (
                type(module).__name__ in wrap if wrap is not None
                else free >= MIN_UNIT_PARAMETERS):
            found.append(module)
            taken.update(id(p) for p in module.parameters())
            return 0
        return free

    visit(model)
    containers = sorted(wrap & {c.__name__ for c in CONTAINERS}) if wrap is not None else []
    if containers:
        raise UsageError("--fsdp-wrap", ",".join(sorted(wrap)), f"{containers[0]} has no "
                         "forward of its own, and fully_shard shards only modules that run one",
                         "name the class of the blocks it holds, or of the module holding it")
    if wrap is not None and not found:
        classes = sorted({type(m).__name__ for m in model.modules()
                          if not isinstance(m, CONTAINERS)})
        raise UsageError("--fsdp-wrap", ",".join(sorted(wrap)), "the model has no submodule "
                         "of these classes", "name classes the model uses "
                         f"({', '.join(classes[:8])})")
    return found


def unit_parameters(model: nn.Module, wrap: frozenset[str] | None) -> list[list[int]]:
    """Each unit's parameters (their element counts), the root's own last: what each gather
    holds whole."""
    found: list[list[int]] = []
    taken: set[int] = set()
    for unit in [*units(model, wrap), model]:
        own = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        found.append([p.numel() for p in own])
    return found


def gathers_flat(shards: int) -> bool:
    """Whether fully_shard all-gathers a unit through a flat buffer: not at one shard, where
    torch 2.14's ``FSDPParamGroup.unshard`` returns early and ``wait_for_unshard`` copies each
    parameter's shard straight into its unsharded storage when its unit runs (nothing is
    gathered ahead)."""
    return shards > 1


def held_beside(model: nn.Module, wrap: frozenset[str] | None, shards: int,
                reshard: bool = True) -> int:
    """Elements fully_shard holds in its backward beyond the sharded state and the largest
    unit's parameters and gradients (what a row counts whole), at the peak over the units, in
    the order fully_shard takes them (the forward's, for a sequence of blocks; the root's own
    parameters first). In a unit's backward, its weights gathered and its gradients whole, the
    reduce-scatter input of the unit after it is kept until this one reduces (torch's
    ``FSDPParamGroup.post_backward``: one such buffer in flight); and ``reshard`` (after the
    forward): the unit before it all-gathered ahead (its flat output, and this rank's shard
    copied in; nothing where it ``gathers_flat`` not); else every unit before it still
    gathered since the forward."""
    *found, root = (sum(unit) for unit in unit_parameters(model, wrap))
    sizes = [root, *found]
    after = [*sizes[1:], 0]
    if reshard:
        ahead = [0, *sizes[:-1]] if gathers_flat(shards) else [0] * len(sizes)
        peak = max(2 * size + (1 + 1 / shards) * before + later
                   for before, size, later in zip(ahead, sizes, after, strict=True))
    else:
        peak = max(sum(sizes[:i + 1]) + size + later
                   for i, (size, later) in enumerate(zip(sizes, after, strict=True)))
    return int(peak) - 2 * max(sizes)


def _reshards(values: Mapping[str, Any], plan: ParallelPlan) -> bool:
    """Whether fully_shard frees a unit's gathered parameters after its forward:
    ``--fsdp-reshard-after-forward`` as parsed, else mpt's default, no under a pipeline."""
    chosen = values["reshard_after_forward"]
    return plan.pp == 1 if chosen is None else chosen


def largest_unit(model: nn.Module, wrap: frozenset[str] | None) -> int:
    """Parameters of the largest unit, the root's own included: what one gather holds whole."""
    return max(sum(unit) for unit in unit_parameters(model, wrap))


class FSDPBackend(DDPBackend):
    """Parameters, gradients and optimizer state sharded over the ranks by ``fully_shard``.

    The units: every submodule whose class ``--fsdp-wrap`` names, else every submodule with at
    least ``MIN_UNIT_PARAMETERS`` parameters of its own, then the whole model for the rest.
    The autocast precisions keep fp32 shards: autocast computes in fp16/bf16 and gradients are
    reduce-scattered in fp32, as under ddp. O2 keeps fp32 shards as its masters and gathers them
    cast (``MixedPrecisionPolicy``), batch norm in fp32 apart; O3 shards the cast model. fp16's
    scaler sees one shard of the gradients per rank and DTensor reduces its overflow verdict over
    the ranks, so every rank skips the same steps.
    """

    name = "fsdp"
    options: ClassVar[dict[str, BackendOption]] = {
        "wrap": BackendOption(help="module classes that become FSDP units, comma-separated "
                                   "(default: each submodule of at least "
                                   f"{MIN_UNIT_PARAMETERS:,} parameters)",
                              parse=parse_class_names, flag="--fsdp-wrap"),
        "reshard_after_forward": BackendOption(
            help="yes: free gathered parameters after each unit's forward and gather them "
                 "again for its backward (under --pipeline-stages also after each "
                 "micro-batch's backward, reduce-scattering its gradients: nothing unsharded "
                 "is kept between micro-batches); no: keep them, one all-gather less per unit "
                 "(default: yes, and no under --pipeline-stages, where a stage runs a forward "
                 "per micro-batch)",
            # a value, not a switch; None: the default, which depends on the pipeline
            parse=lambda argument, value: parse_bool(argument, value), default=None,
            flag="--fsdp-reshard-after-forward"),
        "replicate": BackendOption(
            help="HSDP: shard within groups of world/R ranks and replicate across R such "
                 "groups (one per node, R = --nodes, keeps the all-gathers inside nodes)",
            parse=parse_count, default=1, flag="--fsdp-replicate"),
        "cpu_offload": BackendOption(
            help="keep the shards, their gradients and the optimizer step in CPU memory",
            parse=parse_bool, default=False, flag="--fsdp-cpu-offload"),
    }

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mesh: Any = None

    @classmethod
    def data_axis(cls, options: Mapping[str, Any]) -> Axis:
        return "dp_shard"

    @classmethod
    def layout_of(cls, world_size: int, options: Mapping[str, Any], *, pp: int = 1,
                  tp: int = 1) -> ParallelPlan:
        """``--fsdp-replicate R`` splits the data-parallel ranks into R replicas of shards."""
        plan = super().layout_of(world_size, options, pp=pp, tp=tp)
        replicas = cls.check_options(options)["replicate"]
        if plan.dp_shard % replicas:
            fits = divisors(plan.dp_shard)
            raise UsageError("--fsdp-replicate", replicas, f"it does not divide the "
                             f"{plan.dp_shard} data-parallel rank(s) into equal shard groups",
                             f"pass one of {', '.join(map(str, fits))}")
        if replicas > 1 and replicas == plan.dp_shard:
            raise UsageError("--fsdp-replicate", replicas, "it leaves one rank per shard group: "
                             "nothing would be sharded", "use --backend ddp for whole "
                             "replicas, or a smaller --fsdp-replicate")
        return dataclasses.replace(plan, dp_replicate=replicas,
                                   dp_shard=plan.dp_shard // replicas)

    @classmethod
    def availability(cls) -> Availability:
        found = super().availability()
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as exc:
            return Availability(available=False, version=torch.__version__,
                                reason=f"this torch has no fully_shard ({exc})",
                                install="pip install torch==2.13.0")
        return found

    @classmethod
    def comm_refusal(cls, comm: GradComm, values: Mapping[str, Any]
                     ) -> tuple[str, Any, str, str] | None:
        if comm.compression == "powersgd":
            return comm.refused("--grad-compression", "has no PowerSGD (fully_shard takes no "
                                "comm hook)", "use --grad-compression bf16 or fp16, or "
                                "--backend ddp or apex for powersgd")
        if comm.bucket_mb is not None:
            return comm.refused("--bucket-mb", "reduce-scatters each unit's gradients in one "
                                "collective and has no bucket size", "leave --bucket-mb out "
                                "and choose the units with --fsdp-wrap")
        return None

    @classmethod
    def pipeline_refusal(cls, schedule: str, split_backward: bool, values: Mapping[str, Any]
                         ) -> tuple[str, Any, str, str] | None:
        if split_backward and values["reshard_after_forward"]:
            return ("--fsdp-reshard-after-forward", "yes", f"--pipeline-schedule {schedule} "
                    "computes the weights' gradients after the inputs', and by then fsdp has "
                    "freed the weights it gathered for them", "leave the flag out (no, under a "
                    "pipeline), or use --pipeline-schedule interleaved-1f1b")
        return None

    @classmethod
    def casts_model(cls, spec: PrecisionSpec) -> bool:
        # A model cast with fp32 masters (O2): the fp32 shards are the masters and each unit
        # gathers its weights in the cast dtype (MixedPrecisionPolicy). A cast without masters
        # (O3) shards the cast model itself.
        return spec.params != spec.master

    @classmethod
    def estimate_memory(cls, model: nn.Module, spec: PrecisionSpec, optimizer_states: int,
                        world_size: int, options: Mapping[str, Any]) -> list[MemoryEstimate]:
        """Shards of weights, gradients and optimizer state in the masters' dtype, 1/N each,
        plus the largest unit's weights and gradients whole in the dtype it gathers them in
        while it runs; offloaded, only that unit stays."""
        values = cls.check_options(options)
        weights, trained = parameter_counts(model)
        kept, gathered = spec.master.itemsize, spec.params.itemsize
        unit = gathered * largest_unit(model, values["wrap"])
        shards = (kept * weights // world_size, kept * trained // world_size,
                  kept * optimizer_states * trained // world_size)
        return [MemoryEstimate(label="fsdp", parameters=shards[0] + unit,
                               gradients=shards[1] + unit, optimizer=shards[2]),
                MemoryEstimate(label="fsdp --fsdp-cpu-offload", parameters=unit,
                               gradients=unit, optimizer=0, host=sum(shards))]

    @classmethod
    def estimate_row(cls, rows: Sequence[MemoryEstimate], options: Mapping[str, Any]
                     ) -> MemoryEstimate:
        """The offloaded row under ``--fsdp-cpu-offload``."""
        return rows[1 if cls.check_options(options)["cpu_offload"] else 0]

    @classmethod
    def estimate_buffers(cls, stage: nn.Module, spec: PrecisionSpec, row: MemoryEstimate,
                         share: float, plan: ParallelPlan, options: Mapping[str, Any],
                         comm: GradComm | None = None, microbatches: int = 1) -> Buffers:
        """What fully_shard holds beside the unit that runs in the backward (which the row
        counts with its unsharded gradients): a reduce-scatter's input and the unit it gathers
        ahead, or, with ``--fsdp-reshard-after-forward no``, the units still gathered since the
        forward (``held_beside``); all of it freed after the backward. Under a pipeline with
        ``--fsdp-reshard-after-forward yes``, one unit gathered ahead (as measured; 1F1B's
        interleaved micro-batches were not traced). Under a pipeline without it: the stage's
        weights and gradients whole instead (torch's ``PipelineStage`` keeps them over the
        micro-batches, and nothing is gathered ahead), and the flat input of a unit's
        reduce-scatter (its gradients copied), all freed after the last backward.

        Under ``--accumulate`` (no gradient sync before the step's last micro-batch) every
        unit keeps its unsharded gradients on its unsharded parameter from its first backward
        until its reduce-scatter in the last (torch's ``FSDPParamGroup.post_backward`` without
        ``reduce_grads``): the whole stage's, in place of the row's shards."""
        values = cls.check_options(options)
        unit = int(spec.params.itemsize * largest_unit(stage, values["wrap"]) * share)
        if plan.pp == 1:
            beside = int(spec.params.itemsize * share * held_beside(
                stage, values["wrap"], plan.dp_shard, _reshards(values, plan)))
            if microbatches > 1:
                whole = spec.params.itemsize * share * parameter_counts(stage)[1]
                beside += int(whole * (1 - 1 / plan.dp_shard))
            return Buffers(held=beside, released=beside + 2 * unit)
        if _reshards(values, plan):
            return Buffers(held=unit, released=3 * unit)
        whole = int(spec.params.itemsize * share * sum(parameter_counts(stage)))
        return Buffers(held=whole - unit, released=whole + unit)

    @classmethod
    def fresh_gradient_in_row(cls, options: Mapping[str, Any]) -> bool:
        """The row's unit of unsharded gradients is where each backward accumulates."""
        return True

    @classmethod
    def plan_variants(cls, world_size: int, pp: int) -> list[dict[str, Any]]:
        """Every ``--fsdp-replicate`` that divides the world (1: plain fsdp, more: HSDP); under
        a pipeline each also with ``--fsdp-reshard-after-forward yes``, which trades M x the
        collectives for a stage that is never kept gathered; and each with
        ``--fsdp-cpu-offload`` (not both at once: the count of layouts doubles per option)."""
        found: list[dict[str, Any]] = [{"replicate": r} for r in divisors(world_size)]
        resharded = [{**options, "reshard_after_forward": True} for options in found]
        offloaded = [{**options, "cpu_offload": True} for options in found]
        return found + (resharded if pp > 1 else []) + offloaded

    @classmethod
    def timed_alone(cls) -> tuple[Mapping[str, Any], ...]:
        """Every layout: fully_shard's hooks around each unit and the DTensor dispatch of
        every parameter, in the forward, the backward and the optimizer's step, which no
        collective or copy prices (measured at one shard, ResNet-18 at batch 8: 56 ms a step
        beyond the plain 80, of which its copies are about 27)."""
        return ({},)

    @classmethod
    def step_traffic(cls, options: Mapping[str, Any], plan: ParallelPlan, spec: PrecisionSpec,
                     parameters: float, microbatches: int = 1,
                     module: nn.Module | None = None, comm: GradComm | None = None
                     ) -> Traffic:
        """Each unit's parameters all-gathered in the forward and, resharded after it (the
        default, not under a pipeline), again in the backward; gradients reduce-scattered;
        all of it prefetched or overlapped over the whole step. Under a pipeline that once per
        schedule, or, with ``--fsdp-reshard-after-forward yes``, once per micro-batch (nothing
        is kept gathered between them). Under ``--accumulate`` (``microbatches`` without a
        pipeline) the gathers run in every micro-batch, the reduce-scatter in the last only.
        HSDP (``--fsdp-replicate R``) does this within each
        shard group, then allreduces the gradient shard across the R replicas. Each is one
        call per unit (of ``module``, where it is given).

        Around each collective fully_shard copies in memory (torch's ``_fsdp_collectives``):
        an all-gather copies the rank's shard into the flat input and the gathered output out
        into the unsharded parameters; a reduce-scatter copies the unsharded gradients into its
        flat input (``chunk_cat``) and divides the shard it gets back: per gather, the shard
        and the whole unit, per reduce-scatter the whole unit and the shard. At one shard
        (``FSDPParamGroup.unshard`` at world size 1) a gather is one copy, each parameter's
        shard into its unsharded storage; the reduce-scatter still copies in and out.

        A cast ``--grad-compression`` is the units' reduce dtype (``foreach_reduce``): the
        gradients are cast as they are copied into the flat input, reduced and divided in it,
        and the shard cast back into a new tensor of the gradients' dtype.

        ``--fsdp-cpu-offload`` keeps the shards in host memory, in the masters' dtype: each
        gather first copies the rank's shard to the device (``FSDPParam.all_gather_inputs``),
        each reduce-scatter's shard of gradients goes back to the host
        (``foreach_reduce``), and the optimizer steps there (``Traffic.host_copies``,
        ``steps_on_host``)."""
        values = cls.check_options(options)
        wire = wire_dtype(comm, spec.reduce)
        width, kept = wire.itemsize, spec.reduce.itemsize  # on the wire; the gradients'
        grads, weights = parameters * width, parameters * spec.params.itemsize
        reshard = _reshards(values, plan)
        # how often the units are gathered, and their gradients reduced, in a step
        if plan.pp > 1:
            gathers = reduces = microbatches if reshard else 1
        else:
            gathers, reduces = microbatches, 1
        held = unit_parameters(module, values["wrap"]) if module is not None else []
        units = max(1, sum(1 for unit in held if unit))  # the units that hold any
        gather = Collective(kind="all_gather", axis="dp_shard", size=weights * gathers,
                            what="parameters", calls=gathers * units)
        reduced_as = dict(what="gradients", dtype=dtype_name(wire), calls=reduces * units)
        found = [gather, *([gather] if reshard else []),
                 Collective(kind="reduce_scatter", axis="dp_shard", size=grads * reduces,
                            **reduced_as)]
        if plan.dp_replicate > 1:
            found.append(Collective(kind="all_reduce", axis="dp_replicate",
                                    size=grads / plan.dp_shard * reduces,
                                    **{**reduced_as, "what": "gradient shard"}))
        around = 1 + 1 / plan.dp_shard  # the whole tensor and its shard
        flat = gathers_flat(plan.dp_shard)
        cast = (kept + width) / 2  # per element read in one dtype and written in the other
        reduce_copies = (parameters * (cast + (width + cast) / plan.dp_shard) if wire != spec.reduce
                         else grads * around)
        fetched = (2 if reshard else 1) * gathers
        copies = fetched * weights * (around if flat else 1) + reduce_copies * reduces
        offload = values["cpu_offload"]
        shard = parameters * spec.master.itemsize / plan.dp_shard
        return Traffic(collectives=tuple(found), window="step", shards_optimizer=True,
                       copies=copies, host_copies=shard * (fetched + reduces) if offload else 0.0,
                       steps_on_host=offload)

    # -- life cycle ---------------------------------------------------------------------------
    group_alone = True  # fully_shard needs a group at 1 rank too (a 2-rank checkpoint resumes)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        meta = on_meta(model)
        if optimizer is None:  # nothing to train: rank 0's weights everywhere, not sharded
            if meta:
                raise UsageError("model", type(model).__name__, "a model without optimizer is "
                                 "not sharded, and this one is on the meta device",
                                 "build it on the CPU")
            self.broadcast_module_(model)
            return model, None
        if optimizer.state:
            raise UsageError("optimizer", type(optimizer).__name__, "it already holds state, "
                             "which fully_shard would leave on the unsharded parameters",
                             "set it up before its first step, and restore state with rt.load")
        if self._mesh is None:  # 2-D under HSDP: fully_shard replicates over its first dim
            self._mesh = self.data_mesh
        self._shard(model, [model], optimizer, reshard=True)
        return model, optimizer

    def _shard(self, model: nn.Module, roots: Sequence[nn.Module],
               optimizer: torch.optim.Optimizer, *, reshard: bool) -> None:
        """``fully_shard`` each of ``roots`` (parts of ``model``, or the model itself) with its
        units over ``self._mesh``, and point ``optimizer`` at the sharded parameters.
        ``reshard``: whether to reshard after forward unless the option says."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        meta = on_meta(model)
        # fully_shard swaps each parameter for a DTensor shard: remember the optimizer's by name.
        name_of = {param: name for name, param in model.named_parameters()}
        unknown = [p for g in optimizer.param_groups for p in g["params"] if p not in name_of]
        if unknown:
            raise UsageError("optimizer", type(optimizer).__name__, f"it holds {len(unknown)} "
                             "tensors that are not parameters of the model set up with it",
                             "build it over model.parameters()")
        offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
                                  if self.option_values["cpu_offload"] else OffloadPolicy())
        chosen = self.option_values["reshard_after_forward"]
        settings = dict(mesh=self._mesh, offload_policy=offload,
                        reshard_after_forward=reshard if chosen is None else chosen)
        spec = self.precision.spec
        # O2: gathered in the cast dtype, reduced in the precision's (the fp32 shards are its
        # masters); O3 and the autocast precisions gather the shards as they are.
        wire = CAST_DTYPES.get(self.comm.compression)  # --grad-compression: the reduce dtype
        kept = MixedPrecisionPolicy(reduce_dtype=wire)
        cast = MixedPrecisionPolicy(param_dtype=spec.params, reduce_dtype=wire or spec.reduce
                                    ) if self.casts_model(spec) else kept
        # Batch norm kept in fp32 beside a cast model: units of their own (FSDP gathers one
        # dtype per unit) that cast neither their weights nor their inputs.
        norms = [m for m in model.modules() if isinstance(m, _BatchNorm)
                 and any(True for _ in m.parameters(recurse=False))
                 ] if spec.norm != spec.params else []
        shards = [(norm, kept) for norm in norms]
        for root in roots:
            shards += [(unit, cast) for unit in [*units(root, self.option_values["wrap"]), root]
                       if unit not in norms]
        if meta:
            check_materialisable(model)
        with rank0_random_state(self) if meta else contextlib.nullcontext():
            for unit, policy in shards:
                if meta:
                    self._materialise(unit)
                fully_shard(unit, mp_policy=policy, **settings)
        sharded = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[name_of[param]] for param in group["params"]]

    def setup_stage(self, stage: nn.Module, chunks: Sequence[nn.Module],
                    optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> None:
        """Each chunk sharded over the stage's replicas (``mesh``), as its own root with its
        units: the schedule calls each chunk's forward, never the stage's. By default torch's
        PipelineStage drives the rest: it keeps the gathered weights and unsharded gradients
        over the micro-batches and reduce-scatters after the last (one all-gather and one
        reduce-scatter per unit and schedule, not M, as torchtitan does under a pipeline).
        ``--fsdp-reshard-after-forward yes`` trades those collectives for memory: see
        ``stage_module``."""
        super().setup_stage(stage, chunks, optimizer, mesh)  # replicas start equal
        self._mesh = mesh
        self._shard(stage, chunks, optimizer, reshard=False)

    def stage_module(self, chunk: nn.Module) -> nn.Module:
        # PipelineStage, seeing an FSDP module, turns off its resharding after backward and
        # its reduce-scatter until the schedule's last micro-batch: every rank then holds its
        # whole stage's weights and gradients, 2 x its share of them more. Asked to reshard,
        # hide the FSDP root from it: FSDP's own hooks reshard and reduce-scatter into the
        # sharded gradients after every micro-batch's backward (M x the collectives).
        if self.option_values["reshard_after_forward"]:
            return _Sharded(chunk)
        return chunk

    def reduce_stage(self, stage: nn.Module, mesh: DeviceMesh) -> None:
        pass  # reduce-scattered by each schedule (or each micro-batch's backward)

    def place(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> nn.Module:
        if on_meta(model) and optimizer is not None and self.layout.tp > 1:
            raise UsageError("model", type(model).__name__, "it is on the meta device, and "
                             "--tensor-parallel splits its layers from whole weights",
                             "build it on the CPU, or drop --tensor-parallel")
        return model if on_meta(model) else super().place(model, optimizer)  # in setup

    def _materialise(self, unit: nn.Module) -> None:
        """The weights of ``unit`` that no unit inside it took, whole, initialised in module
        order (``mpt.backends.meta``) and moved where they train; ``fully_shard`` then keeps
        this rank's piece only."""
        target = torch.device("cpu") if self.option_values["cpu_offload"] else self.device
        for module in unit.modules():
            if on_meta(module, recurse=False):
                materialise(module, target)

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        # Off: backward keeps unsharded gradients and reduce-scatters nothing until the last
        # micro-batch of the step.
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard changes the module in place; names stay the user's

    # -- state for checkpoints: the DTensor shards themselves (DDPBackend's local_*) ---------
    @property
    def holds_dtensors(self) -> bool:
        return True  # every parameter is a shard


class _Sharded(nn.Module):
    """An FSDP chunk as torch's PipelineStage runs it when nothing may stay gathered between
    micro-batches: a plain module around it, so the stage leaves FSDP's hooks as they are."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.chunk(*args, **kwargs)
