"""``apex.fp16_utils.loss_scaler``: a static and a dynamic loss scale, as Apex kept them.

fp16 gradients of small losses underflow to zero; the loss is multiplied by a scale before
backward and the gradients divided by it after. The dynamic scaler halves the scale (and the step
is skipped) when a gradient overflows, and doubles it after ``scale_window`` clean steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _overflowed(params: Iterable[torch.Tensor]) -> bool:
    """Whether any gradient of ``params`` holds an inf or a NaN."""
    grads = [p.grad for p in params if p.grad is not None]
    return bool(grads) and not all(torch.isfinite(g).all() for g in grads)


class LossScaler:
    """A static loss scale: it never changes and never reports an overflow."""

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        """Nothing to update: the scale is static."""

    def scale_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """Apex's dynamic scale: start at ``init_scale``, divide by ``scale_factor`` on overflow,
    multiply by it after ``scale_window`` steps without one."""

    def __init__(self, init_scale: float = 2.0**32, scale_factor: float = 2.0,
                 scale_window: int = 1000) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return _overflowed(params)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1.0)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
