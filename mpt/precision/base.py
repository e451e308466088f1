"""The precision interface, and full fp32 as its plainest member."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mpt.precision.forward import AutocastForward


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of ``dtype`` without its module (``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionSpec:
    """What a precision does to the numbers of a step: the contract a backend maps onto its
    engine, or refuses before anything starts (``Backend.precision_refusal``)."""

    name: str
    """The ``--precision`` name."""
    compute: torch.dtype
    """dtype of the forward's matmuls and convolutions (autocast's, or the cast model's)."""
    params: torch.dtype
    """dtype of the model's weights while it trains (batchnorm may stay fp32 where cast)."""
    master: torch.dtype
    """dtype of the weights the optimizer steps: fp32 masters, or the weights themselves."""
    reduce: torch.dtype
    """dtype of the gradients reduced across ranks (the weights' own)."""
    norm: torch.dtype
    """dtype of batch norm's weights and statistics: fp32 where a cast model keeps them so."""
    autocast: bool
    """Whether the forward runs under ``torch.autocast`` (else the model itself is cast)."""
    loss_scaling: Literal["none", "static", "dynamic"]
    """How losses are scaled before backward so that small fp16 gradients survive."""

    @classmethod
    def full(cls, name: str, dtype: torch.dtype = torch.float32) -> PrecisionSpec:
        """Everything in ``dtype``, nothing scaled."""
        return cls(name=name, compute=dtype, params=dtype, master=dtype, reduce=dtype,
                   norm=dtype, autocast=False, loss_scaling="none")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaleState:
    """Where a loss scale stands: what checkpoints keep and engines with their own scaler
    (DeepSpeed) exchange with mpt's, instead of GradScaler's private fields."""

    scale: float
    """The current scale."""
    clean_steps: int = 0
    """Finite steps since the scale last grew or backed off; it grows at ``growth_interval``."""

    @classmethod
    def of(cls, scaler: torch.amp.GradScaler) -> LossScaleState:
        return cls.from_state_dict(scaler.state_dict())

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LossScaleState:
        """From ``GradScaler.state_dict()``, the layout mpt's checkpoints keep."""
        return cls(scale=float(state["scale"]), clean_steps=int(state.get("_growth_tracker", 0)))

    def state_dict(self, *, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                   growth_interval: int = 2000) -> dict[str, Any]:
        """As ``GradScaler.state_dict()`` lays it out, with the given schedule."""
        return {"scale": self.scale, "growth_factor": growth_factor,
                "backoff_factor": backoff_factor, "growth_interval": growth_interval,
                "_growth_tracker": self.clean_steps}


class Precision:
    """What a numeric format does to a training step: autocast, loss scaling and their state.

    One instance per run. Backends call ``scale_loss`` before backward, ``unscale_`` before clipping
    and ``optimizer_step`` instead of ``optimizer.step()``, so loss scaling is written once here and
    never again in a backend.
    """

    name: str
    """The ``--precision`` name."""

    @property
    def spec(self) -> PrecisionSpec:
        """What this precision does to the numbers (see ``PrecisionSpec``)."""
        return PrecisionSpec.full(self.name)

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.skipped_steps = 0
        """Optimizer steps skipped because the gradients were not finite."""
        self.before_unscale: Callable[[torch.optim.Optimizer], None] | None = None
        """Called with the optimizer right before its gradients are unscaled (once per step):
        where ranks hold different parts of the gradients, the backend's agreement on an
        overflow, so that the scaler of every rank sees the same verdict."""

    def autocast(self) -> AbstractContextManager[Any]:
        """Context for the forward pass and the loss."""
        return contextlib.nullcontext()

    def autocast_forward(self, module: torch.nn.Module) -> torch.nn.Module:
        """Make every forward of ``module`` (what ``rt.setup`` returns) run under ``autocast()``
        where its caller is not in one already, so that a script with no ``rt.autocast()``
        trains in this precision all the same; formats that cast the weights instead (or
        compute in fp32) leave it as it is. See ``mpt.precision.forward``."""
        spec = self.spec
        if spec.autocast:
            AutocastForward(self.device_type, spec.compute).attach(module)
        return module

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

    def leave_cast_to_backend(self) -> None:
        """The backend keeps the weights in fp32 as the optimizer's masters and casts them to
        ``spec.params`` itself as it gathers them (fsdp's ``MixedPrecisionPolicy``): the
        precision then casts neither the weights nor keeps masters of its own. Only formats
        that cast the model (``spec.params`` below fp32) are asked."""

    def setup_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Adapt the optimizer to the format once, after the backend wrapped the model.

        Formats that keep fp32 master weights (Apex O2) swap them into the param groups here.
        """

    def model_parameter(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The model's parameter behind one the optimizer steps (a master copy's original)."""
        return param

    def weights_to_save(self, module: torch.nn.Module,
                        state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights a checkpoint keeps of ``module``, from its ``state_dict``: formats that
        step fp32 masters of a cast model put those in place of the cast weights, so that any
        backend and precision resumes from the weights at full precision."""
        return state

    def weights_loaded(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """``state`` was just loaded into ``module``: formats with masters take theirs from it
        (exactly where the checkpoint kept fp32 weights)."""

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 where the format does not scale)."""
        return 1.0

    @property
    def loss_scale_state(self) -> LossScaleState | None:
        """Where the dynamic loss scale stands; None where nothing is scaled dynamically."""
        return None

    @loss_scale_state.setter
    def loss_scale_state(self, state: LossScaleState) -> None:
        """Take over ``state`` (an engine's own scaler's); nothing to do where none is kept."""

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))


class FP32Precision(Precision):
    """Full single precision: no autocast, no scaling."""

    name = "fp32"
