"""``apex.fp16_utils.FP16_Optimizer``: fp32 master weights and loss scaling around an optimizer.

It wraps an optimizer built over a half-precision model's parameters: each fp16 parameter is
replaced in the optimizer by an fp32 master copy, ``backward`` scales the loss, gradients are
copied to the masters and unscaled, ``step`` skips a step whose gradients overflowed and copies
the stepped masters back into the model. Apex's methods and ``state_dict`` keys are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mpt.compat.apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler
from mpt.errors import UsageError


class FP16_Optimizer:
    """See the module docstring; ``dynamic_loss_args`` are DynamicLossScaler's arguments."""

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False,
                 dynamic_loss_args: dict[str, Any] | None = None, verbose: bool = True) -> None:
        self.optimizer = init_optimizer
        self.verbose = verbose
        self.fp16_groups: list[list[nn.Parameter]] = []
        self.fp32_from_fp16_groups: list[list[nn.Parameter]] = []
        self.fp32_from_fp32_groups: list[list[nn.Parameter]] = []
        for group in init_optimizer.param_groups:
            halves, masters, floats = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype == torch.float16:
                    master = nn.Parameter(param.detach().clone().float())
                    group["params"][i] = master
                    halves.append(param)
                    masters.append(master)
                    moved = init_optimizer.state.pop(param, None)
                    if moved is not None:
                        init_optimizer.state[master] = moved
                elif param.dtype == torch.float32:
                    floats.append(param)
                else:
                    raise UsageError("FP16_Optimizer parameter", param.dtype, "only fp16 and "
                                     "fp32 parameters are supported", "cast the model with "
                                     "network_to_half or .float()")
            self.fp16_groups.append(halves)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(floats)
        self.dynamic_loss_scale = dynamic_loss_scale
        self.loss_scaler: LossScaler = (DynamicLossScaler(**(dynamic_loss_args or {}))
                                        if dynamic_loss_scale else LossScaler(static_loss_scale))
        self.overflow = False
        self.first_closure_call_this_step = True

    # -- what the training loop calls ---------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups (holding the fp32 masters), e.g. for LR schedules."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def _model_params(self) -> list[nn.Parameter]:
        return [p for group in self.fp16_groups + self.fp32_from_fp32_groups for p in group]

    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Clear the model's gradients (the masters' are overwritten each step)."""
        for param in self._model_params():
            if set_grads_to_None:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_().zero_()

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True,
                 retain_graph: bool = False) -> None:
        """Backward of the scaled loss; then the masters' gradients, unless told to wait (for
        gradient accumulation over several backward passes)."""
        self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Check the model's gradients for overflow, then copy them, unscaled, to the masters."""
        self.overflow = self.loss_scaler.has_overflow(self._model_params())
        if self.overflow:
            return
        for halves, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups, strict=True):
            for half, master in zip(halves, masters, strict=True):
                master.grad = None if half.grad is None else half.grad.detach().float()
        scale = self.loss_scale
        if scale != 1.0:
            for master in self._master_params():
                if master.grad is not None:
                    master.grad.div_(scale)

    def _master_params(self) -> list[nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        """Clip the masters' (unscaled) gradients; their norm, or -1 after an overflow."""
        if self.overflow:
            return -1.0
        return float(torch.nn.utils.clip_grad_norm_(self._master_params(), max_norm,
                                                     norm_type=norm_type))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the masters and copy them into the model; skip the step after an overflow."""
        if closure is not None:
            raise UsageError("FP16_Optimizer.step", "closure", "closures are not supported "
                             "here", "call backward before step()")
        scale = self.loss_scale
        self.loss_scaler.update_scale(self.overflow)
        if self.overflow:
            if self.verbose:
                print(f"OVERFLOW! Skipping step. Attempted loss scale: {scale}, reducing to "
                      f"{self.loss_scale}", flush=True)
            return None
        result = self.optimizer.step()
        with torch.no_grad():
            for halves, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups,
                                       strict=True):
                for half, master in zip(halves, masters, strict=True):
                    half.copy_(master)
        return result

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]]:
        """The masters' gradients, per group (None where a parameter got none)."""
        return [[None if p.grad is None else p.grad.detach() for p in group["params"]]
                for group in self.optimizer.param_groups]

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": vars(self.loss_scaler).copy(),
                "dynamic_loss_scale": self.dynamic_loss_scale, "overflow": self.overflow,
                "first_closure_call_this_step": self.first_closure_call_this_step,
                "optimizer_state_dict": self.optimizer.state_dict(),
                "fp32_from_fp16": [[p.detach().clone() for p in group]
                                   for group in self.fp32_from_fp16_groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore scaler, optimizer and masters (the masters' values, not the model's)."""
        if state["dynamic_loss_scale"] != self.dynamic_loss_scale:
            raise UsageError("dynamic_loss_scale", state["dynamic_loss_scale"], "the checkpoint "
                             "was saved with the other loss scaling", "build FP16_Optimizer "
                             "with the same dynamic_loss_scale")
        vars(self.loss_scaler).update(state["loss_scaler"])
        self.overflow = state["overflow"]
        self.first_closure_call_this_step = state["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        with torch.no_grad():
            for group, saved in zip(self.fp32_from_fp16_groups, state["fp32_from_fp16"],
                                    strict=True):
                for master, value in zip(group, saved, strict=True):
                    master.copy_(value)
