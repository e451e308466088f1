"""Autocast mixed precision (fp16 with loss scaling, bf16 without) on top of ``torch.amp``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mpt.errors import UsageError
from mpt.precision.base import LossScaleState, Precision, PrecisionSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaleConfig:
    """How fp16 losses are scaled so that small gradients survive the cast (Micikevicius 2018)."""

    dynamic: bool = True
    """Grow the scale after ``growth_interval`` clean steps and back it off on overflow."""
    init_scale: float = 2.0**16
    """The first scale (dynamic) or the only one (static)."""
    growth_factor: float = 2.0
    """Multiplier applied after ``growth_interval`` consecutive finite steps."""
    backoff_factor: float = 0.5
    """Multiplier applied when a step overflowed."""
    growth_interval: int = 2000
    """Consecutive finite steps before the scale grows."""

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise UsageError("--loss-scale", self.init_scale, "the loss scale must be positive",
                             "pass 'dynamic' or a number such as 128")
        if not self.growth_factor > 1.0:
            raise UsageError("growth_factor", self.growth_factor, "it must be above 1",
                             "use 2.0, the usual value")
        if not 0.0 < self.backoff_factor < 1.0:
            raise UsageError("backoff_factor", self.backoff_factor, "it must be in (0, 1)",
                             "use 0.5, the usual value")
        if self.growth_interval < 1:
            raise UsageError("growth_interval", self.growth_interval, "it must be at least 1",
                             "use 2000, the usual value")

    @classmethod
    def parse(cls, value: str | float) -> LossScaleConfig:
        """``"dynamic"`` or a number (a static scale), as given to ``--loss-scale``."""
        if value == "dynamic":
            return cls()
        try:
            return cls(dynamic=False, init_scale=float(value))
        except ValueError:
            raise UsageError("--loss-scale", value, "it is neither 'dynamic' nor a number",
                             "pass --loss-scale dynamic or --loss-scale 128") from None


class MixedPrecision(Precision):
    """Parameters and optimizer in fp32; forward under ``torch.autocast`` in ``dtype``.

    fp16 gradients underflow, so fp16 scales the loss with ``torch.amp.GradScaler`` (dynamic, or
    static through ``update(new_scale=...)``); a step whose gradients hold an inf or NaN is skipped
    and counted. bf16 has fp32's exponent range and needs no scaling.
    """

    def __init__(self, device_type: str, dtype: torch.dtype,
                 loss_scale: LossScaleConfig | None = None) -> None:
        super().__init__(device_type)
        self.dtype = dtype
        self.name = "fp16-mixed" if dtype == torch.float16 else "bf16-mixed"
        self.scaling = loss_scale or LossScaleConfig()
        self.scaler: torch.amp.GradScaler | None = None
        if dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(
                device_type,
                init_scale=self.scaling.init_scale,
                growth_factor=self.scaling.growth_factor,
                backoff_factor=self.scaling.backoff_factor,
                growth_interval=self.scaling.growth_interval,
            )
        # ids of optimizers already unscaled this step: clipping and stepping share one unscale.
        self._unscaled: set[int] = set()

    @property
    def spec(self) -> PrecisionSpec:
        return PrecisionSpec(name=self.name, compute=self.dtype, params=torch.float32,
                             master=torch.float32, reduce=torch.float32, norm=torch.float32,
                             autocast=True,
                             loss_scaling=self._scaling_kind())

    def _scaling_kind(self) -> Literal["none", "static", "dynamic"]:
        if self.scaler is None:
            return "none"
        return "dynamic" if self.scaling.dynamic else "static"

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            if self.before_unscale is not None:
                self.before_unscale(optimizer)
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is None:
            optimizer.step()
            return True
        self.unscale_(optimizer)
        self._unscaled.discard(id(optimizer))
        # The verdict, without reading the scaler's private state: GradScaler calls the
        # optimizer's step only when the gradients are finite (it waits for the device to know),
        # except for optimizers that skip by themselves (fused Adam), which it hands the verdict
        # as ``optimizer.found_inf`` for the duration of the step: read only for those.
        ran: list[torch.Tensor | None] = []
        hook = optimizer.register_step_post_hook(
            lambda opt, _args, _kwargs: ran.append(getattr(opt, "found_inf", None)))
        try:
            self.scaler.step(optimizer)
        finally:
            hook.remove()
        stepped = bool(ran) and (ran[0] is None or not ran[0].item())
        self.skipped_steps += int(not stepped)
        return stepped

    def update(self) -> None:
        if self.scaler is None:
            return
        if self.scaling.dynamic:
            self.scaler.update()
        else:
            self.scaler.update(new_scale=self.scaling.init_scale)

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else float(self.scaler.get_scale())

    @property
    def loss_scale_state(self) -> LossScaleState | None:
        """The scaler's state (None where nothing is scaled dynamically)."""
        return None if self.scaler is None else LossScaleState.of(self.scaler)

    @loss_scale_state.setter
    def loss_scale_state(self, state: LossScaleState) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state.state_dict(
                growth_factor=self.scaling.growth_factor,
                backoff_factor=self.scaling.backoff_factor,
                growth_interval=self.scaling.growth_interval))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
