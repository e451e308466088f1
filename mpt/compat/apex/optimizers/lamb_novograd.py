"""Apex's FusedLAMB and FusedNovoGrad, for where Apex's CUDA kernels are not: torch has neither.

The arithmetic is that of Apex's ``multi_tensor_lamb`` and ``multi_tensor_novograd`` kernels,
written with plain tensor operations per parameter (fp32 maths, the result cast back to the
parameter's dtype). The state layout is this module's own: ``exp_avg``/``exp_avg_sq`` per
parameter (NovoGrad: ``exp_avg`` and the per-tensor ``grad_norm``), ``step`` per group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpt.compat.apex.optimizers.torch_backed import Params, _ApexZeroGrad, _refuse


def _bias_corrections(group: dict[str, Any], power: float) -> tuple[float, float]:
    """``1 - beta1**t`` and ``(1 - beta2**t) ** power``, or 1s without bias correction."""
    if not group["bias_correction"]:
        return 1.0, 1.0
    beta1, beta2 = group["betas"]
    step = group["step"]
    return 1 - beta1 ** step, (1 - beta2 ** step) ** power


def _evaluate(closure: Callable[[], Any] | None) -> Any:
    """The loss of a ``step(closure)`` call (None without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _next_step(group: dict[str, Any]) -> tuple[float, float, float]:
    """Count the group's step; its ``beta1``, ``beta2`` and the gradient's weight in the first
    moment (``1 - beta1`` with Apex's ``grad_averaging``, else 1)."""
    group["step"] = group.get("step", 0) + 1
    beta1, beta2 = group["betas"]
    return beta1, beta2, 1 - beta1 if group["grad_averaging"] else 1.0


class FusedLAMB(_ApexZeroGrad):
    """LAMB (You et al., 2019) as ``apex.optimizers.FusedLAMB`` computes it.

    Per step: the gradients of all parameters are divided by ``global_norm / max_grad_norm``
    when their global norm exceeds ``max_grad_norm``; Adam moments give an update (weight decay
    decoupled with ``adam_w_mode``, else L2 on the gradient); the parameter moves by
    ``lr * ||p|| / ||update||`` times the update where weight decay is non-zero (or always,
    ``use_nvlamb``), by ``lr`` times it elsewhere.
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False) -> None:
        if amsgrad:
            _refuse("amsgrad", True, "FusedLAMB has no AMSGrad variant (Apex refused it too)",
                    "drop the argument")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                      eps=eps, weight_decay=weight_decay,
                                      grad_averaging=grad_averaging,
                                      max_grad_norm=max_grad_norm))
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _evaluate(closure)
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return loss
        global_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        max_norm = self.defaults["max_grad_norm"]
        clip = torch.where(global_norm > max_norm, global_norm / max_norm, 1.0)
        for group in self.param_groups:
            beta1, beta2, beta3 = _next_step(group)
            correction1, correction2 = _bias_corrections(group, 1.0)
            decay = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                m, v, weight = state["exp_avg"], state["exp_avg_sq"], p.float()
                grad = p.grad.float() / clip
                if not self.adam_w_mode:
                    grad = grad + decay * weight  # L2 on the clipped gradient
                m.mul_(beta1).add_(grad, alpha=beta3)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = (m / correction1) / ((v / correction2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + decay * weight
                ratio = torch.tensor(group["lr"], device=p.device)
                if self.use_nvlamb or decay != 0:
                    p_norm, u_norm = (torch.linalg.vector_norm(t) for t in (weight, update))
                    trusted = (p_norm != 0) & (u_norm != 0)
                    ratio = torch.where(trusted, group["lr"] * p_norm / u_norm, ratio)
                p.copy_(weight - ratio * update)
        return loss


class FusedNovoGrad(_ApexZeroGrad):
    """NovoGrad (Ginsburg et al., 2019) as ``apex.optimizers.FusedNovoGrad`` computes it.

    The second moment is one number per tensor: a running blend of its gradient's norm (L2:
    ``sqrt(beta2 * n_old**2 + (1 - beta2) * n**2)``; ``norm_type=0``, the max norm: a linear
    blend), started at the first step's norm (or 0 with ``init_zero``). The gradient divided by
    it feeds the first moment (``reg_inside_moment``: with the weight decay added there; else the
    decay is added to the update).
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False,
                 set_grad_none: bool = True) -> None:
        if amsgrad:
            _refuse("amsgrad", True, "FusedNovoGrad has no AMSGrad variant (Apex refused it "
                    "too)", "drop the argument")
        if norm_type not in (0, 2):
            _refuse("norm_type", norm_type, "NovoGrad blends the L2 norm (2) or the max norm (0)",
                    "pass norm_type=2 or 0")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                      eps=eps, weight_decay=weight_decay,
                                      grad_averaging=grad_averaging, norm_type=norm_type,
                                      init_zero=init_zero))
        self.reg_inside_moment = reg_inside_moment
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _evaluate(closure)
        for group in self.param_groups:
            beta1, beta2, beta3 = _next_step(group)
            correction1, correction2 = _bias_corrections(group, 0.5)
            decay, l2 = group["weight_decay"], group["norm_type"] == 2
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, weight, state = p.grad.float(), p.float(), self.state[p]
                norm = torch.linalg.vector_norm(grad, ord=2 if l2 else float("inf"))
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["grad_norm"] = torch.zeros_like(norm) if group["init_zero"] else norm
                old = state["grad_norm"]
                state["grad_norm"] = ((beta2 * old**2 + (1 - beta2) * norm**2).sqrt() if l2
                                      else beta2 * old + (1 - beta2) * norm)
                denominator = state["grad_norm"] / correction2 + group["eps"]
                m = state["exp_avg"]
                if self.reg_inside_moment:
                    m.mul_(beta1).add_(grad / denominator + decay * weight, alpha=beta3)
                    update = m / correction1
                else:
                    m.mul_(beta1).add_(grad, alpha=beta3)
                    update = (m / correction1) / denominator + decay * weight
                p.copy_(weight - group["lr"] * update)
        return loss
