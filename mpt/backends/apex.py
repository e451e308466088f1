"""Backend ``apex``: torch DDP with the knobs of Apex's ``DistributedDataParallel``.

Upstream Apex dropped ``apex.parallel`` in 2025; its knobs map onto torch DDP directly:
``message_size`` (elements per allreduce) is DDP's bucket size, ``delay_allreduce`` is one
bucket holding every gradient (reduced once backward is done), and ``allreduce_always_fp32``,
``gradient_predivide_factor`` and ``gradient_average`` live in a DDP communication hook.
Real Apex pieces are used where they import (see ``apex_pieces``).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real types.
import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mpt.backends.base import Availability
from mpt.backends.ddp import DDPBackend
from mpt.errors import MissingDependencyError, UsageError

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
    tensor = buffer.float() if state.allreduce_always_fp32 else buffer
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


class ApexDistributedDataParallel(TorchDDP):
    """torch's DDP taking Apex's constructor arguments (``apex.parallel.DistributedDataParallel``).

    Arguments that only steered Apex's CUDA streams or buffers (``num_allreduce_streams``,
    ``allreduce_communicators``, ``allreduce_different_streams``, ``retain_allreduce_buffers``,
    ``prof``) are accepted and have no effect: torch DDP manages its own.
    """

    def __init__(self, module: nn.Module, message_size: int = APEX_MESSAGE_SIZE,
                 delay_allreduce: bool = False, shared_param: Any = None,
                 allreduce_trigger_params: Any = None, retain_allreduce_buffers: bool = False,
                 allreduce_always_fp32: bool = False, num_allreduce_streams: int = 1,
                 allreduce_communicators: Any = None, gradient_average: bool = True,
                 gradient_predivide_factor: float = 1.0,
                 gradient_average_split_factor: float | None = None, prof: bool = False,
                 process_group: dist.ProcessGroup | None = None) -> None:
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
        if delay_allreduce:  # one bucket over everything: it is full only when backward ends
            total = sum(p.numel() * p.element_size() for p in params)
            bucket_mb = total / _MB + 1.0
        else:
            element = params[0].element_size() if params else 4
            bucket_mb = message_size * element / _MB
        device = params[0].device if params else torch.device("cpu")
        # A per-bucket cap list, not bucket_cap_mb: torch then buckets by it from the first
        # step on, instead of one bucket first and its own defaults when it rebuilds them.
        super().__init__(module, device_ids=[device.index] if device.type == "cuda" else None,
                         bucket_cap_mb_list=[bucket_mb], process_group=process_group)
        self.reduce_settings = ReduceSettings(
            allreduce_always_fp32=allreduce_always_fp32,
            gradient_predivide_factor=float(gradient_predivide_factor),
            gradient_average=gradient_average, process_group=process_group)
        """The hook's settings; ``buckets_reduced`` counts the allreduces it sent."""
        self.register_comm_hook(self.reduce_settings, apex_allreduce_hook)


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes", "false", "0", "no"):
        return str(value).lower() in ("true", "1", "yes")
    raise UsageError(name, value, "it must be true or false", f"pass {name}=true")


def _number(name: str, value: Any, kind: type[int] | type[float]) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise UsageError(name, value, f"it is not a {kind.__name__}",
                         f"pass a number, e.g. {name}={kind(1)}") from None


class ApexBackend(DDPBackend):
    """DDP with Apex DDP's knobs; pair it with ``--precision O0..O3`` for Apex's amp."""

    name = "apex"
    options: ClassVar[dict[str, str]] = {
        "delay_allreduce": "reduce all gradients once backward is done, in one bucket",
        "message_size": f"elements per allreduce bucket (Apex's default {APEX_MESSAGE_SIZE})",
        "allreduce_always_fp32": "reduce fp16/bf16 gradients in fp32",
        "gradient_predivide_factor": "divide gradients by this before the allreduce, multiply "
                                     "by it / world size after",
        "gradient_average": "average gradients over ranks (false: sum)",
        "fused_optimizer": "swap torch Adam/AdamW for apex.optimizers.FusedAdam (needs Apex)",
    }

    @classmethod
    def availability(cls) -> Availability:
        base = super().availability()
        pieces = apex_pieces()
        using = ", ".join(pieces) if pieces else "native torch only (NVIDIA Apex not importable)"
        return Availability(available=base.available, version=f"{base.version}; apex: {using}",
                            reason=base.reason, install=base.install)

    def ddp_kwargs(self) -> dict[str, Any]:
        """The options as ``ApexDistributedDataParallel`` arguments."""
        o = self.option_values
        kwargs: dict[str, Any] = {}
        if "delay_allreduce" in o:
            kwargs["delay_allreduce"] = _bool("delay_allreduce", o["delay_allreduce"])
        if "allreduce_always_fp32" in o:
            kwargs["allreduce_always_fp32"] = _bool("allreduce_always_fp32",
                                                    o["allreduce_always_fp32"])
        if "gradient_average" in o:
            kwargs["gradient_average"] = _bool("gradient_average", o["gradient_average"])
        if "message_size" in o:
            kwargs["message_size"] = _number("message_size", o["message_size"], int)
        if "gradient_predivide_factor" in o:
            kwargs["gradient_predivide_factor"] = _number(
                "gradient_predivide_factor", o["gradient_predivide_factor"], float)
        return kwargs

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        kwargs = self.ddp_kwargs()  # bad options fail on one process too
        if optimizer is None:
            return super().setup(model, None)
        if _bool("fused_optimizer", self.option_values.get("fused_optimizer", False)):
            optimizer = fused_adam(optimizer)
        if not self.world.is_distributed:
            return model, optimizer
        return ApexDistributedDataParallel(model, **kwargs), optimizer


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
