"""The precision interface, and full fp32 as its plainest member."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch


class Precision:
    """What a numeric format does to a training step: autocast, loss scaling and their state.

    One instance per run. Backends call ``scale_loss`` before backward, ``unscale_`` before clipping
    and ``optimizer_step`` instead of ``optimizer.step()``, so loss scaling is written once here and
    never again in a backend.
    """

    name: str
    """The ``--precision`` name."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.skipped_steps = 0
        """Optimizer steps skipped because the gradients were not finite."""

    def autocast(self) -> AbstractContextManager[Any]:
        """Context for the forward pass and the loss."""
        return contextlib.nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast the model's parameters where the format keeps them in a lower precision."""
        return module

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward`` on."""
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the gradients back to their true size, once per step (before clipping)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer unless the gradients overflowed; return whether it stepped."""
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the loss scale once per training iteration, after every optimizer stepped
        (several models share one scale, as in torch's recipe for several optimizers)."""

    def setup_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Adapt the optimizer to the format once, after the backend wrapped the model.

        Formats that keep fp32 master weights (Apex O2) swap them into the param groups here.
        """

    def model_parameter(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The model's parameter behind one the optimizer steps (a master copy's original)."""
        return param

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 where the format does not scale)."""
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))


class FP32Precision(Precision):
    """Full single precision: no autocast, no scaling."""

    name = "fp32"
