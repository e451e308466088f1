"""``apex.amp`` on mpt's precisions: initialize, scale_loss, master_params, state_dict.

Like Apex, ``initialize`` returns the same model and optimizer objects, cast and patched: the
optimizer's ``step`` skips overflowed steps and copies fp32 masters back into the model, its
``zero_grad`` also clears the model's gradients. Patching the instance (rather than wrapping it)
keeps it a real ``torch.optim.Optimizer`` for learning-rate schedulers, as Apex did.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpt.errors import UsageError
from mpt.precision.amp_config import AmpConfig
from mpt.precision.apex import ApexPrecision
from mpt.precision.mixed import LossScaleConfig


@dataclass(kw_only=True, slots=True)
class _AmpState:
    """What ``initialize`` set up; one per process, as in Apex."""

    precision: ApexPrecision
    """The opt level in use."""
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    """The optimizers ``initialize`` patched."""


_state: _AmpState | None = None


def _require_state(caller: str) -> _AmpState:
    if _state is None:
        raise UsageError(caller, "called before amp.initialize", "amp has no opt level yet",
                         "call model, optimizer = amp.initialize(model, optimizer, "
                         "opt_level='O1') first")
    return _state


def _as_list(obj: Any) -> list[Any]:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def initialize(models: Any, optimizers: Any = None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: torch.dtype | None = None,
               patch_torch_functions: bool | None = None,
               keep_batchnorm_fp32: bool | str | None = None,
               master_weights: bool | None = None, loss_scale: float | str | None = None,
               cast_model_outputs: torch.dtype | None = None, num_losses: int = 1,
               verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float = 2.0**24) -> Any:
    """Cast ``models`` and patch ``optimizers`` for ``opt_level``; returns them as given.

    Apex's arguments; ``min_loss_scale``/``max_loss_scale`` are not enforced (torch's scaler
    has no bounds) and say so.
    """
    global _state
    if not enabled:
        return models if optimizers is None else (models, optimizers)
    if num_losses != 1:
        raise UsageError("num_losses", num_losses, "mpt keeps one loss scaler",
                         "use num_losses=1 and one scale_loss per backward")
    if patch_torch_functions is not None and patch_torch_functions != (opt_level == "O1"):
        raise UsageError("patch_torch_functions", patch_torch_functions, "it follows from the "
                         "opt level (only O1 patches torch functions)", "drop the argument")
    if min_loss_scale is not None or max_loss_scale != 2.0**24:
        warnings.warn("amp.initialize: min_loss_scale/max_loss_scale are not enforced by "
                      "torch's GradScaler", stacklevel=2)
    overrides = {"cast_model_type": cast_model_type, "keep_batchnorm_fp32": keep_batchnorm_fp32,
                 "master_weights": master_weights, "loss_scale": loss_scale,
                 "cast_model_outputs": cast_model_outputs}
    config = AmpConfig.resolve(opt_level, {k: v for k, v in overrides.items() if v is not None})
    model_list = _as_list(models)
    first = next((p for m in model_list for p in m.parameters()), None)
    device_type = first.device.type if first is not None else "cpu"
    precision = ApexPrecision(device_type, config, LossScaleConfig())
    for model in model_list:
        precision.convert_module(model)
    optimizer_list = [] if optimizers is None else _as_list(optimizers)
    for optimizer in optimizer_list:
        for model in model_list:
            precision.setup_optimizer(model, optimizer)
        _patch(optimizer, precision)
    _state = _AmpState(precision=precision, optimizers=optimizer_list)
    if verbosity > 0:
        print(f"mpt.compat.apex.amp: opt_level {config.name} ({_describe(config)})", flush=True)
    return models if optimizers is None else (models, optimizers)


def _describe(config: AmpConfig) -> str:
    cast = "unchanged" if config.cast_model_type is None else str(config.cast_model_type)
    return (f"cast_model_type={cast}, autocast={config.patch_torch_functions}, "
            f"keep_batchnorm_fp32={config.keep_batchnorm_fp32}, "
            f"master_weights={config.master_weights}, loss_scale={config.loss_scale}")


class _AmpStep:
    """``optimizer.step`` through the precision: skip on overflow, masters back to the model."""

    def __init__(self, optimizer: torch.optim.Optimizer, original: Callable[..., Any],
                 precision: ApexPrecision) -> None:
        self.optimizer = optimizer
        self.original = original
        self.precision = precision
        self.inside = False

    def __call__(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise UsageError("optimizer.step", "closure", "amp does not support closures "
                             "(neither did Apex)", "compute the loss before calling step()")
        if self.inside:  # the scaler calling step() on our behalf: the real step
            self.original()
            return
        self.inside = True
        try:
            self.precision.optimizer_step(self.optimizer)
        finally:
            self.inside = False


def _patch(optimizer: torch.optim.Optimizer, precision: ApexPrecision) -> None:
    original_zero_grad = optimizer.zero_grad
    original_load = optimizer.load_state_dict

    def zero_grad(set_to_none: bool = True) -> None:
        precision.zero_model_grads()
        original_zero_grad(set_to_none=set_to_none)

    def load_state_dict(state: dict[str, Any]) -> None:
        original_load(state)
        precision.sync_masters_from_model()  # as Apex: masters follow the loaded model

    optimizer.step = _AmpStep(optimizer, optimizer.step, precision)  # type: ignore[method-assign]
    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]


@contextmanager
def scale_loss(loss: torch.Tensor, optimizers: Any, loss_id: int = 0,
               model: nn.Module | None = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
    """``with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()``.

    On exit the gradients are unscaled (into the fp32 masters under O2) unless
    ``delay_unscale``, which gradient accumulation uses on all but the last micro-batch.
    """
    state = _require_state("amp.scale_loss")
    if loss_id != 0:
        raise UsageError("loss_id", loss_id, "mpt keeps one loss scaler", "use loss_id=0")
    yield state.precision.scale_loss(loss)
    if not delay_unscale:
        for optimizer in _as_list(optimizers):
            state.precision.unscale_(optimizer)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters the optimizer steps (fp32 masters under O2), e.g. for gradient clipping."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apex's format: ``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}}``."""
    precision = _require_state("amp.state_dict").precision
    unskipped = 0
    if precision.scaler is not None:
        unskipped = int(precision.scaler.state_dict().get("_growth_tracker", 0))
    destination = {} if destination is None else destination
    destination["loss_scaler0"] = {"loss_scale": precision.loss_scale, "unskipped": unskipped}
    return destination


def load_state_dict(state: dict[str, Any]) -> None:
    """Restore the loss scaler from ``amp.state_dict()`` (Apex's or mpt's, same format)."""
    precision = _require_state("amp.load_state_dict").precision
    if "loss_scaler0" not in state:
        raise UsageError("amp state", sorted(state)[:3], "no 'loss_scaler0' entry",
                         "pass the 'amp' entry of the checkpoint, as saved by amp.state_dict()")
    if len(state) > 1:
        warnings.warn(f"amp.load_state_dict: {len(state)} loss scalers saved; mpt restores "
                      "'loss_scaler0' only", stacklevel=2)
    saved = state["loss_scaler0"]
    if precision.scaler is None:
        return  # this opt level does not scale dynamically: nothing to restore
    scaling = precision.scaling
    precision.scaler.load_state_dict({
        "scale": float(saved["loss_scale"]), "growth_factor": scaling.growth_factor,
        "backoff_factor": scaling.backoff_factor, "growth_interval": scaling.growth_interval,
        "_growth_tracker": int(saved.get("unskipped", 0))})


__all__ = ["initialize", "load_state_dict", "master_params", "scale_loss", "state_dict"]
