"""Horovod: ring-allreduce of gradients through Horovod's fused allreduce, started by horovodrun.

Each optimizer's gradients are reduced by the time that optimizer steps (or clips first): every
gradient is handed to Horovod's allreduce under its parameter's name, Horovod's background
thread fuses them into few buffers (its tensor fusion), and the step waits for all. This is
what ``hvd.DistributedOptimizer.synchronize()`` does, without the rules its autograd hooks
impose: no refusal of two backward passes before a step (``errD_real.backward();
errD_fake.backward()`` in a GAN), nor of a ``zero_grad`` after a backward that never stepped
(the discriminator's gradients left by the generator's loss): several models, losses and
optimizers work as under ``ddp``.

With one optimizer set up (one model trained), each gradient's allreduce starts from a hook as
soon as backward has accumulated it, as Horovod's own optimizer does, so communication overlaps
the rest of backward. The step uses that result only if the gradient is still the one the hook
read (same tensor, no write since: a second backward, an edit by the script); otherwise it
reduces the gradient again, so the rules above still hold. With several optimizers (a GAN),
a backward reaches models whose optimizer is not the next to step, and everything is reduced at
the step. ``horovod`` is imported here only, when the backend is used.

``--horovod-op adasum`` is refused before any process starts where the installed Horovod was
built without MPI (``hvd.mpi_built()``, a build flag read without ``hvd.init()``): Horovod runs
Adasum only through its MPI operations, so such a build, or a job whose Horovod talks over gloo,
fails at the first allreduce ("No Adasum operation enabled"). A job started over gloo with an
MPI build is refused by its launcher, and by ``hvd.mpi_enabled()`` right after ``hvd.init()``.

Gradient communication: ``--grad-compression fp16`` is Horovod's ``Compression.fp16``; bf16 and
PowerSGD are refused (Horovod 0.28 has no bf16 tensors and no PowerSGD). ``--bucket-mb`` is
Horovod's tensor-fusion buffer, which Horovod reads once, from ``HOROVOD_FUSION_THRESHOLD``, when
``hvd.init()`` starts its background thread: it is exported here, just before, and nowhere else.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import os
import socket
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from mpt.backends.base import Availability, Backend, BackendOption, LaunchOption
from mpt.comm import GradComm
from mpt.errors import MissingDependencyError, UsageError
from mpt.estimate import Buffers, MemoryEstimate
from mpt.parallel import ParallelPlan
from mpt.parallel.traffic import Traffic
from mpt.parse import one_of, parse_size
from mpt.precision import PrecisionSpec

if TYPE_CHECKING:
    from mpt.backends.base import Launch

INSTALL = ("run `mpt install horovod` (builds Horovod 0.28.1 patched for C++20 against this "
           "torch, with HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1, and installs it; see "
           "docs/horovod.md)")
"""How to get a Horovod that works with this torch: its sdist needs a C++20 patch to build."""

OPS = ("average", "sum", "adasum")
FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"
"""Bytes of Horovod's tensor-fusion buffer, read by ``hvd.init()``."""
FUSION_DEFAULT = 128 * 2**20
"""Horovod's tensor-fusion buffer where ``FUSION_THRESHOLD`` is not set."""
_COLLECTIVE_OPS = {"mean": "Average", "sum": "Sum", "max": "Max", "min": "Min"}


def _import_horovod() -> ModuleType:
    """``horovod.torch``, or one error that says how to build it."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise MissingDependencyError("backend 'horovod'", "horovod with PyTorch support",
                                     INSTALL, reason=str(exc)) from None
    if not hvd.gloo_built() and not hvd.mpi_built():
        raise MissingDependencyError("backend 'horovod'", "horovod with gloo or MPI", INSTALL,
                                     reason="this horovod was built without either")
    return hvd


ADASUM_HINT = ("pass --horovod-op average, or use a Horovod built with MPI (HOROVOD_WITH_MPI=1) "
               "and start the job with `mpt launch --hosts H1,H2 --horovod-controller mpi`")
"""How to reduce with Adasum, which Horovod runs only over MPI (its gloo has none)."""


def _check_adasum_built() -> None:
    """Refuse ``--horovod-op adasum`` where the installed Horovod has no MPI, hence no Adasum;
    without Horovod, the backend's import says how to get one."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return
    if not hvd.mpi_built():
        raise UsageError("--horovod-op", "adasum", "this Horovod was built without MPI, and "
                         "Horovod runs Adasum only over MPI (its gloo has none)", ADASUM_HINT)


def _path(argument: str, value: Any) -> Path:
    """A launch option's file (``--hostfile``); whether it reads is the launcher's to say."""
    return Path(value)


def _refuse_bf16(what: str, tensor: torch.Tensor) -> None:
    if tensor.dtype == torch.bfloat16:
        raise UsageError(what, "torch.bfloat16", "Horovod cannot allreduce bf16 tensors",
                         "keep parameters in fp32 and use --precision bf16-mixed (autocast "
                         "computes in bf16, gradients stay fp32)")


def _contiguous_during(slots: Iterable[tuple[MutableMapping[Any, Any], Any]],
                       collective: Callable[[], object]) -> None:
    """Run ``collective`` with every tensor at ``slots`` (mapping, key) contiguous: Horovod
    refuses others ("Tensor is required to be contiguous"), such as channels_last conv weights
    and the optimizer state made like them. Such a tensor is swapped for a contiguous copy,
    which is copied back into it afterwards, so it keeps its layout."""
    swapped = []
    for mapping, key in slots:
        value = mapping[key]
        if isinstance(value, torch.Tensor) and not value.is_contiguous():
            mapping[key] = value.contiguous()
            swapped.append((mapping, key, value))
    try:
        collective()
    finally:
        for mapping, key, original in swapped:
            original.copy_(mapping[key])
            mapping[key] = original


def _broadcast_parameters(hvd: ModuleType, state: dict[str, torch.Tensor]) -> None:
    """``hvd.broadcast_parameters`` from rank 0 of a state dict, tensors of any layout."""
    _contiguous_during([(state, name) for name in state],
                       lambda: hvd.broadcast_parameters(state, root_rank=0))


def _broadcast_optimizer_state(hvd: ModuleType, optimizer: torch.optim.Optimizer) -> None:
    """``hvd.broadcast_optimizer_state`` from rank 0, state tensors of any layout."""
    _contiguous_during([(state, key) for state in optimizer.state.values() for key in state],
                       lambda: hvd.broadcast_optimizer_state(optimizer, root_rank=0))


@dataclass(frozen=True, slots=True)
class _Started:
    """An allreduce a backward hook started for one gradient."""

    grad: torch.Tensor
    """The gradient tensor it read."""
    version: int
    """That tensor's version counter then: any write since bumps it."""
    context: Any
    """The compression's context, to decompress the result."""
    sent: torch.Tensor
    """What is reduced in place: the gradient's compressed or plain copy."""
    handle: int
    """Horovod's handle, to wait for it."""

    def current(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s gradient is still what was sent."""
        return param.grad is self.grad and self.grad._version == self.version


class HorovodBackend(Backend):
    """Horovod's fused allreduce of each optimizer's gradients by its step (from backward hooks
    where one optimizer is set up); parameters and optimizer state broadcast from rank 0."""

    name = "horovod"
    launcher = "horovodrun"
    elastic = False  # Horovod's rendezvous serves one fixed round (launchers.horovod_join)
    snapshots = False  # no torch.distributed process group: Horovod's own collectives
    # one call per fill of the tensor-fusion buffer (Horovod fuses what is ready each cycle,
    # so it may send more)
    default_bucket: ClassVar[float] = FUSION_DEFAULT
    options: ClassVar[dict[str, BackendOption]] = {
        "op": BackendOption(help=f"gradient reduction: {', '.join(OPS)}", parse=one_of(*OPS),
                            default="average", flag="--horovod-op"),
        "cycle_time_ms": BackendOption(
            help="wait between fusion cycles in ms (a horovodrun flag, applied by `mpt "
            "launch`)", parse=parse_size, flag="--cycle-time-ms"),
    }
    launch_options: ClassVar[dict[str, LaunchOption]] = {
        "hosts": LaunchOption(
            help="start every node from here through horovodrun (over ssh), one host per node; "
            "without it each node runs `mpt launch --nr R`", flag="--hosts", metavar="H1,H2",
            selects_launcher=True),
        "hostfile": LaunchOption(help="as --hosts, from 'HOST slots=N' lines", parse=_path,
                                 flag="--hostfile", metavar="FILE", selects_launcher=True),
        "controller": LaunchOption(help="horovodrun's controller, gloo or mpi", default="gloo",
                                   flag="--horovod-controller", metavar="C",
                                   applies_with="with --hosts/--hostfile"),
    }
    """horovodrun's (``mpt.launchers.horovodrun`` reads them and checks the controller where
    it uses it)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.op: str = self.option_values["op"]
        self.hvd: ModuleType | None = None
        self._grad_names: dict[int, dict[torch.Tensor, str]] = {}
        """Per optimizer (by id), each parameter's name in Horovod's allreduce queue."""
        self._reduced: set[int] = set()
        """Optimizers (ids) whose gradients this step already reduced (clipping does it)."""
        self._started: dict[nn.Parameter, _Started] = {}
        """The allreduces backward hooks started, by parameter, waited for at the step."""
        self._sync_off: set[int] = set()
        """Models (ids) whose next backward is not the last micro-batch of a step."""
        self._buffers: dict[nn.Parameter, torch.Tensor] = {}
        """The copy a hook sends of each uncompressed gradient, kept from step to step."""
        self._torch_group = False
        """Whether init_process_group started the torch.distributed group beside Horovod's."""

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        values = super().check_options(options)
        if values["op"] == "adasum":
            _check_adasum_built()
        return values

    @classmethod
    def precision_refusal(cls, spec: PrecisionSpec, device_type: str,
                          options: Mapping[str, Any]) -> tuple[str, str] | None:
        if spec.reduce == torch.bfloat16:
            return ("would allreduce bf16 gradients, and Horovod has no bf16 tensors",
                    "use --precision bf16-mixed (bf16 compute, fp32 gradients), or --backend "
                    "ddp or apex for " + spec.name)
        return None

    @classmethod
    def check_launch(cls, spec: Launch) -> None:
        """What `mpt launch` without ``--hosts`` cannot give Horovod (``horovod_launch``): a
        restart of the gang, a host name of loopback across machines, Adasum over gloo."""
        from mpt.backends import horovod_launch

        horovod_launch.check_restarts(spec)
        horovod_launch.check_host_name(spec)
        horovod_launch.check_op(spec)

    @classmethod
    def worker_env(cls, spec: Launch) -> dict[str, str]:
        """Horovod's cycle time, which ``hvd.init()`` reads from the environment only: the
        variable horovodrun makes of its ``--cycle-time-ms`` flag."""
        cycle_time = spec.run.backend_options.get("cycle_time_ms")
        return {} if cycle_time is None else {"HOROVOD_CYCLE_TIME": str(cycle_time)}

    @classmethod
    def comm_refusal(cls, comm: GradComm, values: Mapping[str, Any]
                     ) -> tuple[str, Any, str, str] | None:
        if comm.compression == "bf16":
            return comm.refused("--grad-compression", "has no bf16 tensors to allreduce",
                                "use --grad-compression fp16 (Horovod's Compression.fp16), or "
                                "--backend ddp or apex for bf16")
        if comm.compression == "powersgd":
            return comm.refused("--grad-compression", "has no PowerSGD",
                                "use --grad-compression fp16, or --backend ddp or apex for "
                                "powersgd")
        return None

    @classmethod
    def accumulation_priced(cls, options: Mapping[str, Any]) -> bool:
        """Priced: the hooks start nothing before the step's last micro-batch."""
        return True

    @classmethod
    def estimate_buffers(cls, stage: nn.Module, spec: PrecisionSpec, row: MemoryEstimate,
                         share: float, plan: ParallelPlan, options: Mapping[str, Any],
                         comm: GradComm | None = None, microbatches: int = 1) -> Buffers:
        """The copy of every gradient mpt hands to Horovod's allreduce (kept from step to
        step) and Horovod's tensor-fusion buffer (``--bucket-mb``, which sets its size, is not
        an option here: its default 128 MiB). Horovod allocates the buffer whole the first time
        it fuses several tensors, and a tensor reduced alone never touches it; what one fusion
        writes depends on which tensors every rank has queued by then, so the gradients fused
        at once are counted at their bound, all of them (``held``), and the rest of the buffer
        where the device's allocator hands it out whole (``reserved``)."""
        written = min(FUSION_DEFAULT, row.gradients)
        return Buffers(held=row.gradients + written, reserved=FUSION_DEFAULT - written)

    @classmethod
    def step_traffic(cls, options: Mapping[str, Any], plan: ParallelPlan, spec: PrecisionSpec,
                     parameters: float, microbatches: int = 1,
                     module: nn.Module | None = None, comm: GradComm | None = None
                     ) -> Traffic:
        """The default's allreduce of the gradients, run by Horovod's own ring: priced by its
        fit where the calibration swept it (``mpt plan --calibrate`` with Horovod installed),
        which on a shared CPU is 1.5-3.3 x torch's gloo allreduce (docs/benchmarks.md), and
        ``--grad-compression fp16`` by its fp16 fit."""
        flow = super().step_traffic(options, plan, spec, parameters, microbatches, module,
                                    comm)
        return dataclasses.replace(flow, collectives=tuple(
            dataclasses.replace(c, library="horovod") for c in flow.collectives))

    @classmethod
    def availability(cls) -> Availability:
        try:
            hvd = _import_horovod()
        except MissingDependencyError as exc:
            return Availability(available=False, reason=str(exc).split(" Fix:")[0],
                                install=INSTALL)
        import horovod

        comms = [n for n, ok in (("gloo", hvd.gloo_built()), ("mpi", hvd.mpi_built()),
                                 ("nccl", hvd.nccl_built())) if ok]
        return Availability(available=True, version=f"{horovod.__version__} ({', '.join(comms)})")

    def _require(self) -> ModuleType:
        if self.hvd is None:
            raise RuntimeError("init_process_group() has not run")
        return self.hvd

    # -- life cycle ---------------------------------------------------------------------------
    def init_process_group(self) -> None:
        # horovodrun, mpirun and `mpt launch` (which hosts Horovod's rendezvous) make hvd.init()
        # join the job; under any other launcher each process would be a job of its own.
        hvd = self.hvd = _import_horovod()
        if self.comm.bucket_mb is not None:
            os.environ[FUSION_THRESHOLD] = str(int(self.comm.bucket_mb * 2**20))
        hvd.init()
        if (hvd.rank(), hvd.size()) != (self.world.rank, self.world.world_size):
            raise UsageError("--backend", "horovod", f"Horovod sees rank {hvd.rank()} of "
                             f"{hvd.size()}, but {self.world.source} started rank "
                             f"{self.world.rank} of {self.world.world_size}: Horovod cannot "
                             "join this launcher's job", "start it with `mpt launch` (any "
                             "backend), `mpt horovodrun` or horovodrun")
        if self.op == "adasum" and hvd.size() > 1 and not hvd.mpi_enabled():
            raise UsageError("--horovod-op", "adasum", "this job's Horovod talks over gloo, and "
                             "Horovod runs Adasum only over MPI", ADASUM_HINT)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._init_torch_group()

    def _init_torch_group(self) -> None:
        """Start a torch.distributed group beside Horovod's (gloo, NCCL on GPUs).

        Scripts call ``dist.*`` and build ``DistributedSampler(dataset)`` with default arguments
        whatever the backend; without a torch group both fail under Horovod only. horovodrun
        exports no MASTER_ADDR/MASTER_PORT, so rank 0 opens a store on a free port and Horovod
        broadcasts where it listens. A group the script started itself is left alone.
        """
        if not self.world.is_distributed or dist.is_initialized():
            return
        hvd = self._require()
        world = self.world
        if world.rank == 0:
            host = world.master_addr or ("127.0.0.1" if world.nodes == 1 else socket.getfqdn())
            store = dist.TCPStore(host, 0, world.world_size, is_master=True,
                                  timeout=self.timeout, wait_for_workers=False)
            hvd.broadcast_object((host, store.port), root_rank=0, name="mpt.torch_group")
        else:
            host, port = hvd.broadcast_object(None, root_rank=0, name="mpt.torch_group")
            store = dist.TCPStore(host, port, world.world_size, is_master=False,
                                  timeout=self.timeout)
        dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo",
                                store=store, rank=world.rank, world_size=world.world_size,
                                timeout=self.timeout)
        self._torch_group = True
        atexit.register(self.shutdown)  # for scripts that never call rt.close()

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        hvd = self._require()
        for name, param in model.named_parameters():
            _refuse_bf16(f"parameter {name}", param)
        if optimizer is None:
            _broadcast_parameters(hvd, model.state_dict())
            return model, None
        self._broadcast(model, optimizer)
        # Names match the same gradient across ranks in Horovod's queue; the index keeps two
        # models' parameters of the same name apart.
        names = {param: name for name, param in model.named_parameters()}
        index = len(self._grad_names)
        grad_names = self._grad_names[id(optimizer)] = {
            param: f"mpt.grad.{index}.{names.get(param, id(param))}"
            for group in optimizer.param_groups for param in group["params"]}
        if self.world.world_size > 1:
            for param, name in grad_names.items():
                param.register_post_accumulate_grad_hook(
                    functools.partial(self._start, id(model), name))
        return model, optimizer

    def _broadcast(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Make every rank start from rank 0's weights and optimizer state."""
        hvd = self._require()
        _broadcast_parameters(hvd, model.state_dict())
        if optimizer.state_dict()["state"]:
            _broadcast_optimizer_state(hvd, optimizer)
            return
        # A fresh optimizer has no state yet. hvd.broadcast_optimizer_state would create it by
        # stepping on zero gradients, which counts a step (Adam's bias correction) and applies
        # weight decay: the run would no longer match a ddp run. Only hyper-parameters differ.
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        for group, values in zip(optimizer.param_groups, self.broadcast_object(groups, 0),
                                 strict=True):
            group.update(values)

    def shutdown(self) -> None:
        if self.hvd is not None and self.hvd.is_initialized():
            for started in self._started.values():  # a backward no step followed
                self.hvd.synchronize(started.handle)
        self._started.clear()
        if self._torch_group and dist.is_initialized():
            self._torch_group = False
            dist.destroy_process_group()
            gc.collect()  # gloo's finished work objects, before teardown (see DDPBackend)
        if self.hvd is not None and self.hvd.is_initialized():
            self.hvd.shutdown()

    # -- the training step --------------------------------------------------------------------
    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """Off: the hooks start nothing for ``model`` (a micro-batch before the step's last)."""
        if enabled:
            self._sync_off.discard(id(model))
        else:
            self._sync_off.add(id(model))

    @functools.cached_property
    def _compression(self) -> Any:
        """Horovod's compressor for ``--grad-compression`` (read once Horovod has started)."""
        hvd = self._require()
        return hvd.Compression.fp16 if self.comm.compression == "fp16" else hvd.Compression.none

    @functools.cached_property
    def _hvd_op(self) -> Any:
        """Horovod's reduce op for ``--horovod-op``."""
        hvd = self._require()
        return {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[self.op]

    def _start(self, model: int, name: str, param: nn.Parameter) -> None:
        """Backward accumulated ``param``'s gradient: start its allreduce where one optimizer
        is set up and this micro-batch is the step's last (see the module's docstring)."""
        if len(self._grad_names) != 1 or model in self._sync_off or param in self._started \
                or param.grad is None:
            return  # a second backward before the step leaves the first one stale
        hvd, grad = self._require(), param.grad
        sent, context = self._compression.compress(grad.contiguous())
        if sent is grad:  # not compressed, so not copied yet
            # A copy goes over the wire, as DDP's buckets do: the gradient may still change (a
            # second backward) while it is sent. One buffer per parameter, kept: a fresh 100 MB
            # each step costs more (page faults) than the copy.
            buffer = self._buffers.get(param)
            if buffer is None or buffer.shape != grad.shape:
                buffer = self._buffers[param] = torch.empty_like(grad)
            sent = buffer.copy_(grad)
        self._started[param] = _Started(grad=grad, version=grad._version, context=context,
                                        sent=sent, handle=hvd.allreduce_async_(
                                            sent, name=name, op=self._hvd_op))

    def _reduce(self, optimizer: torch.optim.Optimizer) -> None:
        """Average ``optimizer``'s gradients over the ranks, once per step."""
        if id(optimizer) in self._reduced or self.world.world_size == 1:
            return  # one process: nothing to average (hvd.DistributedOptimizer skips it too)
        self._reduced.add(id(optimizer))
        hvd, compression, op = self._require(), self._compression, self._hvd_op
        pending = []
        for param, name in self._grad_names[id(optimizer)].items():
            started = self._started.pop(param, None)
            if started is not None and started.current(param):
                pending.append((param, started.sent, started.context, started.handle))
                continue
            if started is not None:  # stale: its name is free once it is done
                hvd.synchronize(started.handle)
            if param.grad is None:  # unused by this step's graph, on every rank alike: as
                continue  # under ddp it keeps no gradient (Adam does not move it)
            # a contiguous copy of a channels_last gradient is reduced, then copied back
            sent, context = compression.compress(param.grad.contiguous())
            pending.append((param, sent, context,
                            hvd.allreduce_async_(sent, name=name, op=op)))
        for param, sent, context, handle in pending:
            hvd.synchronize(handle)
            if sent is not param.grad:  # a copy went over the wire
                param.grad.copy_(compression.decompress(sent, context))

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self._reduce(optimizer)  # clip the reduced gradients, not this rank's own
        return super().clip_grad_norm_(model, optimizer, max_norm, norm_type)

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        self._reduce(optimizer)  # the scaler must unscale (and inf-check) reduced grads
        try:
            return self.precision.optimizer_step(optimizer)
        finally:
            self._reduced.discard(id(optimizer))

    # -- state for checkpoints ----------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # Horovod wraps the optimizer, not the model

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        super().load_model_state_dict(model, state)
        _broadcast_parameters(self._require(), model.state_dict())

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        super().load_optimizer_state_dict(model, optimizer, state)
        if optimizer.state_dict()["state"]:
            _broadcast_optimizer_state(self._require(), optimizer)

    # -- collectives --------------------------------------------------------------------------
    def broadcast_tensor_(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._require().broadcast_(tensor, root_rank=src, name=f"mpt.tensor.{src}")

    def barrier(self) -> None:
        self._require().barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        hvd = self._require()
        _refuse_bf16("all_reduce tensor", tensor)
        if op not in _COLLECTIVE_OPS:
            raise UsageError("op", op, "unknown reduction", f"use one of "
                             f"{', '.join(_COLLECTIVE_OPS)}")
        return hvd.allreduce_(tensor, op=getattr(hvd, _COLLECTIVE_OPS[op]))

    def sum_async(self, tensor: torch.Tensor) -> Callable[[], None]:
        hvd = self._require()
        # One at a time (the runtime waits before it starts the next), so one name serves.
        handle = hvd.allreduce_async_(tensor, op=hvd.Sum, name="mpt.sum_async")
        return lambda: hvd.synchronize(handle)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        # Horovod matches collectives across ranks by name, and names this one after the type
        # of obj by default: a None on the receiving ranks would never meet rank src's dict.
        return self._require().broadcast_object(obj, root_rank=src, name=f"mpt.object.{src}")
