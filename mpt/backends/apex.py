"""Backend ``apex``: torch DDP with the knobs of Apex's ``DistributedDataParallel``.

Upstream Apex dropped ``apex.parallel`` in 2025; its knobs map onto torch DDP directly:
``message_size`` (elements per allreduce; the backend's ``--bucket-mb``) is DDP's bucket size,
``delay_allreduce`` is one bucket holding every gradient (reduced once backward is done), and
``allreduce_always_fp32``, ``gradient_predivide_factor`` and ``gradient_average`` live in a DDP
communication hook, which also casts buckets for ``--grad-compression fp16|bf16``.
``--grad-compression powersgd`` replaces that hook by torch's PowerSGD (see ``mpt.backends.ddp``).
Real Apex pieces are used where they import (see ``apex_pieces``).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real types.
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mpt.backends.base import CAST_DTYPES, Availability, BackendOption
from mpt.backends.ddp import POWERSGD_OPTIONS, DDPBackend, bucket_kwargs
from mpt.comm import GradComm
from mpt.errors import MissingDependencyError, UsageError
from mpt.parse import parse_bool, parse_number

_MB = 2**20
APEX_MESSAGE_SIZE = 10_000_000
"""Apex's default ``message_size``, in elements."""

_PIECES = {"FusedAdam": "apex.optimizers", "FusedLAMB": "apex.optimizers",
           "FusedLayerNorm": "apex.normalization"}
"""Apex pieces mpt can use, and the module each lives in."""


def apex_pieces() -> dict[str, Any]:
    """The real Apex classes that import here, by name (empty without NVIDIA Apex)."""
    found = {}
    for name, module in _PIECES.items():
        try:
            found[name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, RuntimeError):  # absent, or built without its ext
            continue
    return found


@dataclass(kw_only=True, slots=True)
class ReduceSettings:
    """What Apex's DDP did to each gradient bucket around the allreduce."""

    allreduce_always_fp32: bool = False
    """Reduce fp16/bf16 buckets in fp32 (summing many fp16 gradients can overflow)."""
    compress_to: torch.dtype | None = None
    """Reduce buckets cast to this dtype (``--grad-compression fp16|bf16``), None: as they are."""
    gradient_predivide_factor: float = 1.0
    """Divide by this before the allreduce and multiply by it / world size after."""
    gradient_average: bool = True
    """Average over ranks (False: sum)."""
    process_group: dist.ProcessGroup | None = None
    """Group to reduce over (the default group when None)."""
    buckets_reduced: int = 0
    """Allreduces sent so far: one per bucket per step."""


def apex_allreduce_hook(state: ReduceSettings,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook with Apex's predivide / fp32 / average rules."""
    group = state.process_group or dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    wire = torch.float32 if state.allreduce_always_fp32 else state.compress_to
    tensor = buffer if wire is None else buffer.to(wire)
    if state.gradient_predivide_factor != 1.0:
        tensor.div_(state.gradient_predivide_factor)
    state.buckets_reduced += 1
    future = dist.all_reduce(tensor, group=group, async_op=True).get_future()  # type: ignore[union-attr]
    after = state.gradient_predivide_factor / (world if state.gradient_average else 1)

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]
        if after != 1.0:
            reduced.mul_(after)
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return future.then(finish)


def apex_bucket_mb(params: list[torch.Tensor], message_size: int, delay_allreduce: bool) -> float:
    """DDP's bucket cap in MiB for Apex's ``message_size`` (elements) over ``params``, or one
    bucket over everything (``delay_allreduce``: it is full only when backward ends)."""
    if delay_allreduce:
        return sum(p.numel() * p.element_size() for p in params) / _MB + 1.0
    element = params[0].element_size() if params else 4
    return message_size * element / _MB


def apex_message_size(params: list[torch.Tensor], mb: float) -> int:
    """Apex's ``message_size`` (elements) of a ``--bucket-mb`` over ``params``."""
    element = params[0].element_size() if params else 4
    return max(1, round(mb * _MB / element))


class ApexDistributedDataParallel(TorchDDP):
    """torch's DDP taking Apex's constructor arguments (``apex.parallel.DistributedDataParallel``).

    Arguments that only steered Apex's CUDA streams or buffers (``num_allreduce_streams``,
    ``allreduce_communicators``, ``allreduce_different_streams``, ``retain_allreduce_buffers``,
    ``prof``) are accepted and have no effect: torch DDP manages its own. ``compress_to`` is
    mpt's: the dtype buckets are reduced in (``--grad-compression fp16|bf16``).
    """

    def __init__(self, module: nn.Module, message_size: int = APEX_MESSAGE_SIZE,
                 delay_allreduce: bool = False, shared_param: Any = None,
                 allreduce_trigger_params: Any = None, retain_allreduce_buffers: bool = False,
                 allreduce_always_fp32: bool = False, num_allreduce_streams: int = 1,
                 allreduce_communicators: Any = None, gradient_average: bool = True,
                 gradient_predivide_factor: float = 1.0,
                 gradient_average_split_factor: float | None = None, prof: bool = False,
                 process_group: dist.ProcessGroup | None = None,
                 compress_to: torch.dtype | None = None) -> None:
        for name, value in (("shared_param", shared_param),
                            ("allreduce_trigger_params", allreduce_trigger_params),
                            ("gradient_average_split_factor", gradient_average_split_factor)):
            if value is not None:
                raise UsageError(name, value, "this Apex argument is not supported (Apex had "
                                 "deprecated it)", f"drop {name}; use delay_allreduce or "
                                 "message_size to steer when gradients are reduced")
        if message_size < 1:
            raise UsageError("message_size", message_size, "it must be at least 1 element",
                             f"use Apex's default {APEX_MESSAGE_SIZE}")
        if not gradient_predivide_factor > 0:
            raise UsageError("gradient_predivide_factor", gradient_predivide_factor,
                             "it must be positive", "use 1.0 (no predivision) or the world size")
        params = [p for p in module.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        super().__init__(module, device_ids=[device.index] if device.type == "cuda" else None,
                         **bucket_kwargs(apex_bucket_mb(params, message_size, delay_allreduce),
                                         small_first=not delay_allreduce),
                         process_group=process_group)
        self.reduce_settings = ReduceSettings(
            allreduce_always_fp32=allreduce_always_fp32, compress_to=compress_to,
            gradient_predivide_factor=float(gradient_predivide_factor),
            gradient_average=gradient_average, process_group=process_group)
        """The hook's settings; ``buckets_reduced`` counts the allreduces it sent."""
        self.register_comm_hook(self.reduce_settings, apex_allreduce_hook)


class ApexBackend(DDPBackend):
    """DDP with Apex DDP's knobs; pair it with ``--precision O0..O3`` for Apex's amp."""

    name = "apex"
    pipelines: ClassVar[bool] = False
    tensor_parallel: ClassVar[bool] = False
    # Apex's default message_size of fp32 gradients (its message_size and delay_allreduce
    # options are not read for the plan's calls)
    default_bucket: ClassVar[float] = APEX_MESSAGE_SIZE * 4.0
    options: ClassVar[dict[str, BackendOption]] = {
        "delay_allreduce": BackendOption(
            help="reduce all gradients after backward, in one bucket", parse=parse_bool,
            flag="--delay-allreduce"),
        "allreduce_always_fp32": BackendOption(
            help="reduce fp16/bf16 gradients in fp32", parse=parse_bool,
            flag="--allreduce-always-fp32"),
        "gradient_predivide_factor": BackendOption(
            help="divide gradients by F before the allreduce, multiply by F/world size after",
            parse=parse_number, flag="--gradient-predivide-factor"),
        "gradient_average": BackendOption(help="average gradients over ranks (false: sum)",
                                          parse=parse_bool),
        "fused_optimizer": BackendOption(
            help="swap torch Adam/AdamW for apex.optimizers.FusedAdam (needs Apex)",
            parse=parse_bool, default=False),
        **POWERSGD_OPTIONS,
    }

    @classmethod
    def availability(cls) -> Availability:
        base = super().availability()
        pieces = apex_pieces()
        using = ", ".join(pieces) if pieces else "native torch only (NVIDIA Apex not importable)"
        return Availability(available=base.available, version=f"{base.version}; apex: {using}",
                            reason=base.reason, install=base.install)

    @classmethod
    def comm_refusal(cls, comm: GradComm, values: Mapping[str, Any]
                     ) -> tuple[str, Any, str, str] | None:
        if comm.bucket_mb is not None and values["delay_allreduce"]:
            return comm.refused("--bucket-mb", "with --delay-allreduce reduces every gradient "
                                "in one bucket", "drop one of --bucket-mb and --delay-allreduce")
        if comm.compression != "none" and values["allreduce_always_fp32"]:
            return comm.refused("--grad-compression", "with --allreduce-always-fp32 reduces in "
                                "fp32", "drop one of --grad-compression and "
                                "--allreduce-always-fp32")
        if comm.compression == "powersgd":
            for name, default in (("gradient_predivide_factor", 1.0), ("gradient_average", True)):
                if values[name] not in (None, default):
                    return comm.refused("--grad-compression", f"reduces with PowerSGD's hook, "
                                        f"which does not apply Apex's {name}", f"drop {name}, "
                                        "or use --grad-compression fp16 or bf16")
        return None

    def ddp_kwargs(self) -> dict[str, Any]:
        """The options as ``ApexDistributedDataParallel`` arguments (``message_size`` comes from
        ``--bucket-mb`` at set-up, where the gradients' element size is known)."""
        return {name: value for name, value in self.option_values.items()
                if value is not None and name in _DDP_KNOBS}

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        kwargs = self.ddp_kwargs()
        if optimizer is None:
            return super().setup(model, None)
        if self.option_values["fused_optimizer"]:
            optimizer = fused_adam(optimizer)
        if not self.world.is_distributed:
            return model, optimizer
        params = [p for p in model.parameters() if p.requires_grad]
        if self.comm.bucket_mb is not None:
            kwargs["message_size"] = apex_message_size(params, self.comm.bucket_mb)
        if self.comm.compression == "powersgd":
            size = kwargs.get("message_size", APEX_MESSAGE_SIZE)
            delay = bool(kwargs.get("delay_allreduce"))
            return self.wrap(model, apex_bucket_mb(params, size, delay),
                             small_first=not delay), optimizer
        compress_to = CAST_DTYPES.get(self.comm.compression)
        return ApexDistributedDataParallel(model, compress_to=compress_to, **kwargs), optimizer


_DDP_KNOBS = ("delay_allreduce", "allreduce_always_fp32", "gradient_predivide_factor",
              "gradient_average")
"""The options that are ``ApexDistributedDataParallel`` arguments."""


def fused_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Apex's FusedAdam over ``optimizer``'s param groups and hyper-parameters (Adam/AdamW)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise UsageError("fused_optimizer", type(optimizer).__name__, "only Adam and AdamW have "
                         "a fused Apex version", "drop fused_optimizer, or use torch.optim.Adam")
    cls = apex_pieces().get("FusedAdam")
    if cls is None:
        raise MissingDependencyError("backend option fused_optimizer", "NVIDIA Apex (with its "
                                     "CUDA extensions)", "build Apex from its source repository "
                                     "with --cuda_ext, or drop fused_optimizer")
    keep = ("params", "lr", "betas", "eps", "weight_decay")
    groups = [{k: v for k, v in g.items() if k in keep} for g in optimizer.param_groups]
    fused: torch.optim.Optimizer = cls(groups, adam_w_mode=isinstance(optimizer,
                                                                      torch.optim.AdamW))
    return fused
