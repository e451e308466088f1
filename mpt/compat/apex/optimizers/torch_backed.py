"""Apex's FusedAdam, FusedSGD and FusedAdagrad as torch's optimizers with Apex's arguments.

Apex's options that torch's optimizers cannot express are refused with a one-line error rather
than silently changing the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mpt.errors import UsageError

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def _materialize(params: Params) -> list[Any]:
    """``params`` as a list (a generator would be used up by looking at it)."""
    return list(params)


def _fused(params: list[Any]) -> bool | None:
    """torch's fused kernels where every parameter is a floating CUDA tensor (what Apex's fused
    optimizers ran on); otherwise torch's default (foreach on CUDA, a for-loop on the CPU)."""
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict)
                                               else [item])]
    if tensors and all(t.is_cuda and t.is_floating_point() for t in tensors):
        return True
    return None


def _refuse(argument: str, value: object, problem: str, hint: str) -> None:
    raise UsageError(argument, value, problem, hint)


class _ApexZeroGrad(torch.optim.Optimizer):
    """``zero_grad()`` sets gradients to None or zero as Apex's ``set_grad_none`` says."""

    set_grad_none: bool = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class FusedAdam(_ApexZeroGrad, torch.optim.Adam):
    """``apex.optimizers.FusedAdam``: Adam, or AdamW with ``adam_w_mode=True`` (Apex's default)."""

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False,
                 master_weights: bool = False) -> None:
        if amsgrad:
            _refuse("amsgrad", True, "FusedAdam has no AMSGrad variant (Apex refused it too)",
                    "use torch.optim.Adam(amsgrad=True)")
        if not bias_correction:
            _refuse("bias_correction", False, "torch's Adam always corrects the moments' bias",
                    "drop the argument (it changes only the first ~1/(1-beta2) steps)")
        if master_weights:
            _refuse("master_weights", True, "fp32 master weights inside the optimizer need "
                    "Apex's CUDA kernels", "keep fp32 parameters, or use amp's O2")
        params = _materialize(params)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode, capturable=capturable,
                         fused=_fused(params))
        self.set_grad_none = set_grad_none


class FusedSGD(_ApexZeroGrad, torch.optim.SGD):
    """``apex.optimizers.FusedSGD``: torch's SGD (weight decay before momentum, Apex's default)."""

    def __init__(self, params: Params, lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: bool = False) -> None:
        if wd_after_momentum:
            _refuse("wd_after_momentum", True, "torch's SGD applies weight decay before the "
                    "momentum", "drop the argument")
        params = _materialize(params)
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, fused=_fused(params))
        self.set_grad_none = set_grad_none  # materialize_master_grads: amp's business here


class FusedAdagrad(_ApexZeroGrad, torch.optim.Adagrad):
    """``apex.optimizers.FusedAdagrad``: torch's Adagrad (L2 weight decay)."""

    def __init__(self, params: Params, lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, set_grad_none: bool = True,
                 adagrad_w_mode: bool = False) -> None:
        if adagrad_w_mode:
            _refuse("adagrad_w_mode", True, "torch's Adagrad has no decoupled weight decay",
                    "drop the argument (L2 weight decay)")
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none
