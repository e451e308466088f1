"""The backend interface: the few operations that differ between DDP, Horovod, DeepSpeed, ..."""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from mpt.comm import GradComm
from mpt.environments import World
from mpt.errors import UsageError
from mpt.estimate import Buffers, MemoryEstimate, parameter_counts
from mpt.parallel import Axis, ParallelPlan
from mpt.parallel.traffic import Collective, Traffic, Window
from mpt.parse import parse_bool, parse_text
from mpt.precision import Precision, PrecisionSpec
from mpt.precision.base import dtype_name
from mpt.state.named import from_named, to_named

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The dtype gradients are reduced in under each cast ``--grad-compression``."""


def wire_dtype(comm: GradComm | None, default: torch.dtype) -> torch.dtype:
    """The dtype gradients are reduced in: the cast ``comm`` names, else ``default`` (the
    backend's own)."""
    return CAST_DTYPES.get(comm.compression if comm else "none", default)


class Launch(Protocol):
    """What a backend's launch checks read of the job `mpt launch` starts
    (``mpt.launchers.LaunchSpec``, which the backends do not import)."""

    run: Any
    """The run's settings (``RunConfig``): its ``backend_options``."""
    nodes: int
    nr: int
    master_addr: str
    master_port: int
    max_restarts: int


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendOption:
    """One of a backend's own options: what it does, how a value is parsed, its default, and
    the `mpt launch` flag generated for it."""

    help: str
    """What it does, for `mpt launch --help` and ``mpt backends``."""
    parse: Callable[[str, Any], Any] = parse_text
    """Turns a value as given (text from a flag or a file, or a typed value from code) into the
    one the backend uses; raises a UsageError naming the argument."""
    default: Any = None
    """The value when not given (None: the backend decides, e.g. from its own config)."""
    flag: str | None = None
    """The `mpt launch` flag (``--zero-stage``); None: only ``--backend-options`` sets it."""
    metavar: str = "VALUE"
    """What the flag's value is called in `mpt launch --help` (``H1,H2``, ``FILE``)."""

    @property
    def is_switch(self) -> bool:
        """A yes/no option: its flag takes no value."""
        return self.parse is parse_bool


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchOption(BackendOption):
    """One of a backend's options of how `mpt launch` starts its job (Horovod's ``--hosts``),
    not of how its workers train: the launcher reads it, the workers never see it."""

    flag: str
    """The `mpt launch` flag: a launch option has no other way in."""
    applies_with: str = ""
    """What else it needs besides its backend, as its help says (``with --hosts``)."""
    selects_launcher: bool = False
    """Given, it hands the whole job to the backend's ``launcher``, started from this node
    (``--hosts``); under another backend it is refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Availability:
    """Whether a backend can run on this machine, as ``mpt backends`` shows it."""

    available: bool
    """True when the backend's packages import and can run here."""
    version: str = ""
    """Version of the package the backend drives (torch, deepspeed, horovod ...)."""
    reason: str = ""
    """Why it cannot run, when it cannot."""
    install: str = ""
    """The command that makes it available."""


def devices_of(module: nn.Module) -> set[torch.device]:
    """The devices ``module``'s parameters and buffers are on: several for a model whose parts
    the script placed on several GPUs itself (model parallelism inside one process)."""
    return {t.device for t in (*module.parameters(), *module.buffers())}


def on_meta(module: nn.Module, recurse: bool = True) -> bool:
    """Whether ``module`` (or, ``recurse=False``, its own tensors) is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(recurse=recurse),
                                   *module.buffers(recurse=recurse)))


class Backend(ABC):
    """How a model and its optimizer are wrapped and how their gradients are reduced.

    A backend gets the ``World`` (who am I), the device and the run's ``Precision``; it never reads
    environment variables or flags itself. Loss scaling stays in the precision: the default
    ``backward``/``optimizer_step``/``clip_grad_norm_`` below route through it, and a backend whose
    engine scales by itself (DeepSpeed) overrides them.
    """

    name: ClassVar[str]
    pipelines: ClassVar[bool] = False
    """Whether the model may be cut into pipeline stages with this backend data-parallel over
    each stage's replicas (``--pipeline-stages``)."""
    snapshots: ClassVar[bool] = True
    """Whether ``--snapshot-every`` can copy state between nodes (a torch.distributed gloo
    group beside the training's collectives)."""
    tensor_parallel: ClassVar[bool] = False
    """Whether the model's layers may be split over ``--tensor-parallel`` ranks (the
    ``tp`` axis) with this backend data-parallel over the groups they form."""
    default_bucket: ClassVar[float] = math.inf
    """Bytes of gradients one call of its allreduce carries where ``--bucket-mb`` is not
    given (DDP's buckets, Apex's messages, Horovod's fusion buffer); inf: all in one."""
    elastic: ClassVar[bool] = True
    """Whether a job may change its world size between restarts (`mpt launch --nodes
    MIN:MAX`)."""
    launcher: ClassVar[str] = "elastic"
    """The module of ``mpt.launchers`` (its ``describe(spec)`` and ``run(spec)``) that starts
    the whole job from one node where a launch option that ``selects_launcher`` is given
    (``horovodrun``); without one every backend's processes are started by torch's elastic
    agent, one `mpt launch --nr R` per node."""
    launch_options: ClassVar[dict[str, LaunchOption]] = {}
    """How `mpt launch` may start the backend's job (flags it generates from them), by name;
    the launcher reads them, parsed and with their defaults, from ``LaunchSpec.launch_options``."""
    options: ClassVar[dict[str, BackendOption]] = {}
    """The backend's own options (``Runtime(backend_options=...)``, `--backend-options`, and the
    flags `mpt launch` generates from them), by name. A subclass reads them, parsed and with
    their defaults, from ``self.option_values``."""

    def __init__(self, *, world: World, device: torch.device, precision: Precision,
                 accumulate: int = 1, timeout: timedelta = timedelta(minutes=30),
                 options: Mapping[str, Any] | None = None, comm: GradComm | None = None,
                 layout: ParallelPlan | None = None) -> None:
        self.option_values: dict[str, Any] = self.check_options(options or {})
        self.layout = layout or self.layout_of(world.world_size, options or {})
        """The job's parallel layout (``RunConfig.layout``'s)."""
        self.comm = comm or GradComm()
        """How gradients go over the wire (``--grad-compression``, ``--bucket-mb``)."""
        self.check_comm(self.comm, self.option_values)
        self.world = world
        self.device = device
        self.precision = precision
        self.accumulate = accumulate
        """Micro-batches per optimizer step; ``backward`` divides the loss by it."""
        self.timeout = timeout
        """How long a collective may wait before it becomes an error instead of a hang."""
        if self.layout.model_size > 1:  # ranks hold different parts of the gradients
            precision.before_unscale = self.agree_on_overflow

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """The job's ``DeviceMesh``, one named dimension per axis of ``layout``; made on first
        use, after ``init_process_group`` (collective: every rank asks for it)."""
        return self.layout.mesh(self.device.type)

    @functools.cached_property
    def data_mesh(self) -> DeviceMesh:
        """The mesh of the data axes a rank averages (or shards) its gradients over: a view of
        ``mesh`` beside model axes, else a mesh of its own (no other groups made)."""
        if self.layout.model_size > 1:
            return self.mesh[self.layout.data_dims]
        return self.layout.data_mesh(self.device.type)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """Every option parsed, with the defaults of those not given; a UsageError names one
        this backend does not have, or a bad value."""
        unknown = sorted(set(options) - set(cls.options))
        if unknown:
            cls._refuse_foreign_flag(unknown[0], options[unknown[0]])
            known = ", ".join(sorted(cls.options)) or "none"
            raise UsageError("backend option", unknown[0], f"backend {cls.name!r} has no such "
                             "option", f"use one of its options ({known}) or another --backend")
        return {name: option.default if options.get(name) is None
                else option.parse(option.flag or f"backend option {name}", options[name])
                for name, option in cls.options.items()}

    @classmethod
    def _refuse_foreign_flag(cls, name: str, value: Any) -> None:
        """Name the flag of another backend's option as the user typed it (``--zero-stage``),
        and the backend it belongs to, rather than the option's internal name."""
        from mpt.backends import registered  # the registry imports this module

        owners = {other: backend.options[name].flag for other, backend in registered().items()
                  if other != cls.name and name in backend.options}
        flag = next((f for f in owners.values() if f is not None), None)
        if flag is None:
            return
        owner = " or ".join(f"--backend {other}" for other, f in owners.items() if f == flag)
        raise UsageError(flag, value, f"{flag} (option {name!r}) belongs to {owner}, and this "
                         f"run's backend is {cls.name}", f"pass {owner.split(' or ')[0]}, or "
                         f"drop {flag}")

    @classmethod
    def precision_refusal(cls, spec: PrecisionSpec, device_type: str,
                          options: Mapping[str, Any]) -> tuple[str, str] | None:
        """Why this backend cannot train ``spec`` right on ``device_type`` with ``options``, and
        what works instead; None where it can (the default: gradients reduced in any dtype)."""
        return None

    @classmethod
    def check_precision(cls, spec: PrecisionSpec, device_type: str,
                        options: Mapping[str, Any]) -> None:
        """Refuse, in one line naming backend, precision and what works, a pair this backend
        would train wrong: `mpt launch` before any process starts, the Runtime before setup."""
        refusal = cls.precision_refusal(spec, device_type, options)
        if refusal is not None:
            reason, instead = refusal
            raise UsageError("--precision", spec.name, f"--backend {cls.name} {reason}", instead)

    @classmethod
    def comm_refusal(cls, comm: GradComm, values: Mapping[str, Any]
                     ) -> tuple[str, Any, str, str] | None:
        """Why this backend cannot communicate gradients as ``comm`` asks with its options
        ``values`` (parsed): ``comm.refused(flag, reason, instead)``; None where it can. The
        default honours nothing but the defaults: a backend says what its engine can do."""
        if comm.compression != "none":
            return comm.refused("--grad-compression", "has no gradient compression",
                                "leave --grad-compression out, or use --backend ddp")
        if comm.bucket_mb is not None:
            return comm.refused("--bucket-mb", "has no bucket size", "leave --bucket-mb out")
        return None

    @classmethod
    def check_launch(cls, spec: Launch) -> None:
        """Refuse, in one line, a job this backend's workers could not run as `mpt launch`
        would start it from this machine (checked before any process starts; nothing by
        default)."""

    @classmethod
    def worker_env(cls, spec: Launch) -> dict[str, str]:
        """Variables this backend's engine reads from the environment only, made from the
        run's options, for every worker `mpt launch` starts (none by default)."""
        return {}

    @classmethod
    def pipeline_refusal(cls, schedule: str, split_backward: bool, values: Mapping[str, Any]
                         ) -> tuple[str, Any, str, str] | None:
        """Why this backend (``pipelines``) cannot run pipeline schedule ``schedule`` (which
        computes the weights' gradients after the inputs' where ``split_backward``, as zero
        bubble schedules do) with its options ``values`` (parsed): the flag, its value, why and
        what works; None where it can."""
        return None

    @classmethod
    def check_comm(cls, comm: GradComm, values: Mapping[str, Any]) -> None:
        """Refuse, in one line naming flag, value, backend and what works, a setting this
        backend cannot honour: `mpt launch` before any process starts (RunConfig), the Runtime
        and a backend built in code again."""
        refusal = cls.comm_refusal(comm, values)
        if refusal is not None:
            flag, value, reason, instead = refusal
            raise UsageError(flag, value, f"--backend {cls.name} {reason}", instead)

    @classmethod
    def casts_model(cls, spec: PrecisionSpec) -> bool:
        """Whether this backend casts the weights to ``spec.params`` itself, keeping fp32 ones
        as the optimizer's masters (``Precision.leave_cast_to_backend``); default: no."""
        return False

    @classmethod
    def default_precision(cls, options: Mapping[str, Any]) -> str | None:
        """The precision the backend's own configuration asks for when ``--precision`` is not
        given (a DeepSpeed config that enables fp16); None: fp32."""
        return None

    @classmethod
    def data_axis(cls, options: Mapping[str, Any]) -> Axis:
        """The ``ParallelPlan`` axis its data parallelism runs on: ``dp_shard`` where it splits
        parameters, gradients or optimizer state over the ranks (fsdp, ZeRO 1-3), else
        ``dp_replicate`` (whole replicas)."""
        return "dp_replicate"

    @classmethod
    def layout_of(cls, world_size: int, options: Mapping[str, Any], *, pp: int = 1,
                  tp: int = 1) -> ParallelPlan:
        """The job's layout at ``world_size`` processes: ``pp`` stages of ``tp`` ranks, the
        backend's data axis over the ranks they leave (a backend with a second data axis
        splits them)."""
        if tp > 1 and not cls.tensor_parallel:
            from mpt.backends import offering  # the registry imports this module

            raise UsageError("--tensor-parallel", tp, f"--backend {cls.name} splits no layer "
                             "over ranks (it has no tensor parallelism)",
                             f"use --backend {offering('tensor_parallel')}, or drop "
                             "--tensor-parallel")
        return ParallelPlan.for_world(world_size, pp=pp, tp=tp,
                                      data_axis=cls.data_axis(options))

    @classmethod
    def default_batch_size(cls, options: Mapping[str, Any], accumulate: int,
                           dp_size: int) -> int | None:
        """The per-rank micro-batch the backend's own configuration names (a DeepSpeed
        config's), which ``rt.batch_size`` gives without a global batch size; None: none."""
        return None

    @classmethod
    def estimate_memory(cls, model: nn.Module, spec: PrecisionSpec, optimizer_states: int,
                        world_size: int, options: Mapping[str, Any]) -> list[MemoryEstimate]:
        """Bytes per rank of ``model`` (built on the meta device) trained in ``spec`` with an
        optimizer keeping ``optimizer_states`` fp32 values per parameter, one row per choice of
        the backend's options worth comparing. The default: a whole replica on every rank."""
        weights, trained = parameter_counts(model)
        masters = 4 * trained if spec.master != spec.params else 0
        return [MemoryEstimate(
            label=cls.name, parameters=weights * spec.params.itemsize,
            gradients=trained * spec.params.itemsize,
            optimizer=4 * optimizer_states * trained + masters)]

    @classmethod
    def estimate_row(cls, rows: Sequence[MemoryEstimate], options: Mapping[str, Any]
                     ) -> MemoryEstimate:
        """The one of ``estimate_memory``'s ``rows`` that ``options`` run, for `mpt plan`,
        which prices one layout. The default: the first (the backend's defaults)."""
        return rows[0]

    @classmethod
    def estimate_buffers(cls, stage: nn.Module, spec: PrecisionSpec, row: MemoryEstimate,
                         share: float, plan: ParallelPlan, options: Mapping[str, Any],
                         comm: GradComm | None = None, microbatches: int = 1) -> Buffers:
        """What a rank holds beyond ``row`` (the ``estimate_row`` of ``stage``, the model or a
        pipeline stage on the meta device) while it trains ``share`` of ``stage``'s parameters
        (its tensor-parallel share) in ``spec`` with ``options`` and ``comm`` (the run's
        ``--grad-compression``) in ``plan``, over ``microbatches`` a step (a pipeline's, or
        ``--accumulate``'s), and what of it the backward frees. The default: none."""
        return Buffers()

    @classmethod
    def timed_alone(cls) -> tuple[Mapping[str, Any], ...]:
        """Options under which `mpt plan --calibrate MODEL` times this backend's own training
        step of the model (``mpt.Runtime``, one micro-batch and the same cut in two), each
        rank in a world of its own in a process of its own (``calibrate.alone_steps``): what
        the step adds beyond the plain one and the copies the plan prices at one rank, per
        micro-batch and per step, is charged to every layout with these options
        (``Model.own_work``). The default: none."""
        return ()

    @classmethod
    def fresh_gradient_in_row(cls, options: Mapping[str, Any]) -> bool:
        """Whether, once micro-batches accumulate, what the memory row and buffers count
        already holds the gradient each later backward makes (fsdp's unit of unsharded
        gradients; ZeRO-3's, reduced and freed at once). Where it does not (the default), `mpt
        plan` counts the largest weight's beside the activations: autograd makes each later
        gradient anew and adds it to the one held."""
        return False

    @classmethod
    def accumulation_priced(cls, options: Mapping[str, Any]) -> bool:
        """Whether `mpt plan` prices ``--accumulate`` without a pipeline for this backend with
        ``options``: its ``step_traffic`` and ``estimate_buffers`` hold for gradients
        accumulated over micro-batches (reduced once a step, in the last micro-batch's
        backward). The default: not."""
        return False

    @classmethod
    def plan_variants(cls, world_size: int, pp: int) -> list[dict[str, Any]]:
        """The option sets that change the layout, what is sent or what is kept, which `mpt
        plan` compares at ``world_size`` ranks in ``pp`` pipeline stages (each with every
        tensor-parallel size). The default: the backend's defaults alone."""
        return [{}]

    @classmethod
    def step_traffic(cls, options: Mapping[str, Any], plan: ParallelPlan, spec: PrecisionSpec,
                     parameters: float, microbatches: int = 1,
                     module: nn.Module | None = None, comm: GradComm | None = None
                     ) -> Traffic:
        """What the backend with ``options`` sends per optimizer step in ``plan`` for a rank
        that trains ``parameters`` parameters (its stage's, its tensor-parallel share) in
        ``spec``, with ``microbatches`` per step under a pipeline, and what it may hide behind;
        ``module``, the stage (on the meta device), for a backend whose buffers follow how it
        groups the modules; ``comm``, the run's ``--grad-compression`` (None: none).

        The default, whole replicas (ddp, apex, horovod): one allreduce of the gradients in
        ``spec.reduce``, bucketed and started from backward hooks, so it may hide behind the
        rest of the backward; under ``--pipeline-stages`` or ``--tensor-parallel`` mpt
        averages one flat bucket after the backward: nothing hidden. The gradients are copied
        into the buckets and, once reduced, back out (torch's DDP with
        ``gradient_as_bucket_view`` off, mpt's flat bucket, Horovod's fusion buffer): twice
        their bytes copied per step (none for a replica alone, which is not wrapped). A cast
        ``--grad-compression`` allreduces in its dtype, cast there and back (torch's
        ``fp16_compress_hook`` and ``bf16_compress_hook``, Horovod's ``Compression.fp16``):
        each element read in one dtype and written in the other, both ways.
        """
        window: Window = "none" if plan.model_size > 1 else "backward"
        wire = wire_dtype(comm, spec.reduce)
        gradients = Collective(kind="all_reduce", axis="dp_replicate",
                               size=parameters * wire.itemsize, what="gradients",
                               dtype=dtype_name(wire), calls=cls.gradient_calls(
                                   parameters * spec.reduce.itemsize, plan, comm))
        copies = 0.0
        if plan.dp_replicate > 1:
            copies = 2 * parameters * spec.params.itemsize
            if wire != spec.reduce:  # cast there and back
                copies += parameters * (spec.reduce.itemsize + wire.itemsize)
        return Traffic(collectives=(gradients,), window=window, shards_optimizer=False,
                       copies=copies)

    @classmethod
    def bucket_cap(cls, comm: GradComm | None) -> float:
        """Bytes of gradients one call carries: ``--bucket-mb``, else ``default_bucket``."""
        return comm.bucket_mb * 2**20 if comm and comm.bucket_mb else cls.default_bucket

    @classmethod
    def gradient_calls(cls, size: float, plan: ParallelPlan, comm: GradComm | None) -> int:
        """The calls the default's allreduce of ``size`` bytes of gradients is made in: one
        per ``bucket_cap``."""
        return max(1, math.ceil(size / cls.bucket_cap(comm)))

    @classmethod
    def availability(cls) -> Availability:
        """Whether this backend can run here; the default suits backends built on torch alone."""
        return Availability(available=True, version=torch.__version__)

    # -- life cycle ---------------------------------------------------------------------------
    @abstractmethod
    def init_process_group(self) -> None:
        """Join the job's other processes (a no-op for a world of one)."""

    @abstractmethod
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Wrap model and optimizer so that ``backward`` leaves averaged gradients.

        Called once per model. A model without an optimizer (an EMA copy, a frozen teacher)
        trains nothing: it is made equal on every rank and left unwrapped.
        """

    def place(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> nn.Module:
        """Move ``model`` to this rank's device, before ``setup``. ``optimizer``: the one that
        comes with it to ``setup`` (a pipeline cuts only a trained model into stages, tensor
        parallelism splits only its layers); its parameter groups follow the parameters that
        placing replaces.

        A model on the meta device has no weights to move: only a backend that materialises it
        piece by piece (fsdp, a pipeline) takes one.
        """
        if on_meta(model):
            raise UsageError("model", type(model).__name__, f"it is on the meta device, and "
                             f"--backend {self.name} needs its weights", "build it on the CPU, "
                             "or use --backend fsdp, which initialises it one unit at a time, "
                             "or --pipeline-stages, which initialises each rank's stage only")
        if len(devices_of(model)) > 1:
            return model  # its parts placed on several GPUs by the script: left where they are
        model = model.to(self.device)
        if optimizer is not None and self.layout.tp > 1:
            from mpt.parallel.tensor import parallelize, tensor_plan

            parallelize(model, optimizer, self.mesh["tp"], tensor_plan(model, self.layout.tp))
        return model

    def shutdown(self) -> None:
        """Leave the process group."""

    # -- the training step --------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: nn.Module | None = None) -> None:
        """Backward of one micro-batch's loss, scaled for precision and accumulation.

        ``model``: the set-up model whose optimizer this loss trains, when the script named it;
        backends that reduce inside autograd's hooks do not need it.
        """
        if self.accumulate > 1:
            loss = loss / self.accumulate
        self.precision.scale_loss(loss).backward()

    def accumulate_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """``rt.step`` on a micro-batch that is not the last of a step: nothing to do by
        default (engines that count micro-batches themselves count it here)."""

    def update_loss_scale(self) -> None:
        """Once per training iteration, after every optimizer stepped."""
        self.precision.update()

    @abstractmethod
    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """Whether the next forward/backward reduces gradients (off on non-final micro-batches)."""

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the true (unscaled) gradients; return their total norm before clipping."""
        self.precision.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # torch's clip takes DTensors of one mesh (fsdp's shards, tensor-parallel layers): the
        # norm is reduced over the ranks before any gradient is scaled; whole for the caller.
        return whole(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type))

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Step unless the gradients overflowed; return whether the parameters changed."""
        return self.precision.optimizer_step(optimizer)

    def agree_on_overflow(self, optimizer: torch.optim.Optimizer) -> None:
        """Where ranks hold different parts of the gradients (the model split over ``tp`` or
        ``pp``), one verdict for all, before the scaler looks (``Precision.before_unscale``): a
        rank whose part is finite while another's overflowed marks its own non-finite too, so
        that every rank skips the step and backs its scale off alike. Collective."""
        import torch.distributed as dist

        grads = [local_part(p.grad) for group in optimizer.param_groups
                 for p in group["params"] if p.grad is not None]
        # On the device throughout: no wait for it here (the scaler waits once, as always).
        bad = torch.zeros(1, device=self.device)
        for grad in grads:
            bad = torch.maximum(bad, (~torch.isfinite(grad).all()).float().to(bad.device))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if grads:  # where another rank's part overflowed, this rank's is marked so too
            grads[0].masked_fill_(bad.reshape(()).bool().to(grads[0].device), float("inf"))

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients after a step (to None: the next backward allocates them)."""
        optimizer.zero_grad(set_to_none=True)

    # -- as the data dimension of a pipeline (``pipelines``) ----------------------------------
    def setup_stage(self, stage: nn.Module, chunks: Sequence[nn.Module],
                    optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> None:
        """Make the replicas of one pipeline stage (``mesh``: the ranks holding it, one per
        replica) start equal and stay so. ``chunks``: the parts of ``stage`` the schedule runs
        (each one's forward is called, ``stage``'s never); ``optimizer`` holds ``stage``'s
        parameters. Only a backend with ``pipelines`` implements it."""
        raise NotImplementedError(f"--backend {self.name} does not pipeline")

    def reduce_stage(self, stage: nn.Module, mesh: DeviceMesh) -> None:
        """Average the gradients of ``stage`` over its replicas, once per optimizer step, after
        the step's last schedule (``setup_stage``'s ``mesh``)."""
        raise NotImplementedError(f"--backend {self.name} does not pipeline")

    def stage_module(self, chunk: nn.Module) -> nn.Module:
        """What torch's ``PipelineStage`` runs for ``chunk`` (one of ``setup_stage``'s
        ``chunks``): the chunk itself, unless the backend wants the stage's own handling of
        its wrapper bypassed."""
        return chunk

    # -- state for checkpoints ----------------------------------------------------------------
    @abstractmethod
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``setup`` returned."""

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unwrapped weights, keyed as the user's module names them (every rank calls);
        fp32 masters in place of the weights a precision casts."""
        module = self.unwrap(model)
        return self.precision.weights_to_save(module, module.state_dict())

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        module = self.unwrap(model)
        module.load_state_dict(state)
        self.precision.weights_loaded(module, state)

    def parameter_names(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """The name of each parameter the optimizer holds, in its param-group order."""
        names = {param: name for name, param in self.unwrap(model).named_parameters()}
        return [names[self.precision.model_parameter(param)]
                for group in optimizer.param_groups for param in group["params"]]

    def optimizer_state_dict(self, model: nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Full optimizer state keyed by parameter name (see ``mpt.state.named``).

        Every rank calls it: a backend that shards the state gathers it here.
        """
        return to_named(optimizer.state_dict(), self.parameter_names(model, optimizer))

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """Restore what ``optimizer_state_dict`` returned, on every rank."""
        optimizer.load_state_dict(from_named(state, self.parameter_names(model, optimizer)))

    def comm_state_dict(self, model: nn.Module) -> list[dict[str, Any]]:
        """State the gradient communication of ``model`` carries from step to step (PowerSGD's
        error feedback), every rank's, in rank order (collective: every rank calls); empty
        where it carries none (the default)."""
        return []

    def load_comm_state_dict(self, model: nn.Module, states: list[dict[str, Any]]) -> None:
        """Restore what ``comm_state_dict`` returned, on every rank."""

    shards_state: ClassVar[bool] = False
    """Whether each rank holds only its pieces of the weights and optimizer state: sharded
    checkpoints then write and read just those (``local_*_state_dict``) and never gather."""

    def local_model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """This rank's pieces of the weights, keyed like ``model_state_dict``, where
        ``shards_state``: ``DTensor`` shards, or ``mpt.state.flat.FlatPiece`` ranges of the
        flattened tensors (collective). The full weights elsewhere. The
        ``load_model_state_dict`` of a backend that shards takes either."""
        return self.model_state_dict(model)

    def local_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                   *, create: bool = False) -> dict[str, Any]:
        """``optimizer_state_dict`` with this rank's pieces, as ``local_model_state_dict``.

        ``create``: an optimizer that has not stepped yet gets its state made first (zeros),
        for a load to read pieces into; without it, such an optimizer has no state to save.
        """
        return self.optimizer_state_dict(model, optimizer)

    # -- collectives the runtime offers to scripts --------------------------------------------
    def broadcast_module_(self, module: nn.Module) -> None:
        """Give every rank rank 0's parameters and buffers (models set up without optimizer)."""
        for tensor in module.state_dict().values():
            self.broadcast_tensor_(tensor)

    @abstractmethod
    def broadcast_tensor_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` with rank ``src``'s, in place."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every process reaches this point."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` across processes in place: ``sum``, ``mean``, ``max`` or ``min``."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank."""

    @abstractmethod
    def sum_async(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Start summing the small CPU ``tensor`` over all ranks in place, off the training
        stream; return the function that waits for the sum. The runtime's per-step decisions
        (preemption) go through it, so no rank ever waits for the device to learn them."""


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its shard where it is a DTensor, else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` gathered over its shards where it is a DTensor (collective), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def holds(kind: type, state: dict[str, Any]) -> bool:
    """Whether ``state`` (by name, one level of nesting) holds pieces of type ``kind``: what a
    sharded checkpoint was read into, in place, instead of whole tensors."""
    return any(isinstance(v, kind) for value in state.values()
               for v in (value.values() if isinstance(value, dict) else [value]))
