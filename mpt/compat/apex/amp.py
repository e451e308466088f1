"""``apex.amp`` on mpt's precisions: initialize, scale_loss, master_params, state_dict.

Like Apex, ``initialize`` returns the same model and optimizer objects, cast and patched: the
optimizer's ``step`` skips a step whose gradients overflowed and copies fp32 masters back into
the model, its ``zero_grad`` also clears the model's gradients. Patching the instance (rather
than wrapping it) keeps it a real ``torch.optim.Optimizer`` for learning-rate schedulers.

Loss scaling is Apex's own, not torch's ``GradScaler``: one scaler per loss (``num_losses``,
``loss_id``), and each ``scale_loss`` unscales only the gradients its own backward produced,
adding them to what earlier backwards left (stashed on entry). So several losses, each with
its own scale, may backpropagate into one optimizer before one ``step``, as in Apex's DCGAN
example; ``GradScaler`` allows one unscale per optimizer and step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpt.errors import UsageError
from mpt.precision.amp_config import AmpConfig
from mpt.precision.apex import ApexPrecision
from mpt.precision.forward import AutocastForward
from mpt.precision.mixed import LossScaleConfig


@dataclass(kw_only=True, slots=True)
class LossScaler:
    """Apex's ``LossScaler``: halve on overflow, double after ``window`` clean updates."""

    scale: float
    """The current loss scale."""
    dynamic: bool
    """Whether the scale moves (``loss_scale="dynamic"``) or stays where it was set."""
    unskipped: int = 0
    """Clean updates since the scale last changed (Apex's checkpoint field)."""
    window: int = 2000
    """Clean updates before the scale doubles."""
    min_scale: float | None = None
    """Floor of a backed-off scale (None: none)."""
    max_scale: float = 2.0**24
    """Ceiling of a grown scale."""

    def update(self, overflow: bool) -> None:
        """Apex's rule, applied after each unscale of a loss."""
        if not self.dynamic:
            return
        if overflow:
            self.scale = self.scale / 2.0
            if self.min_scale is not None:
                self.scale = max(self.scale, self.min_scale)
            self.unskipped = 0
            return
        self.unskipped += 1
        if self.unskipped == self.window:
            self.scale = min(self.scale * 2.0, self.max_scale)
            self.unskipped = 0


@dataclass(kw_only=True, slots=True)
class _Stash:
    """Per optimizer: the unscaled gradients of earlier losses, and whether to skip its step."""

    grads: dict[int, torch.Tensor | None] = field(default_factory=dict)
    """Gradient of each stepped parameter (by id) before the current loss's backward."""
    scaled_pending: bool = False
    """A ``delay_unscale`` backward left scaled gradients that the next unscale handles."""
    skip: bool = False
    """An unscale since the last step found an inf or NaN: the next step is skipped."""


@dataclass(kw_only=True, slots=True)
class _AmpState:
    """What ``initialize`` set up; one per process, as in Apex."""

    precision: ApexPrecision
    """The opt level: casts, fp32 masters."""
    scalers: list[LossScaler]
    """One per loss (``num_losses``), chosen by ``loss_id``."""
    stashes: dict[int, _Stash] = field(default_factory=dict)
    """By id of each optimizer ``initialize`` patched."""


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
    """Cast ``models`` and patch ``optimizers`` for ``opt_level``; returns them as given
    (a model or a list of models, an optimizer or a list of optimizers). Apex's arguments."""
    global _state
    if not enabled:
        return models if optimizers is None else (models, optimizers)
    if not isinstance(num_losses, int) or num_losses < 1:
        raise UsageError("num_losses", num_losses, "it counts the losses that scale_loss "
                         "scales", "pass num_losses=1 or more")
    if patch_torch_functions is not None and patch_torch_functions != (opt_level == "O1"):
        raise UsageError("patch_torch_functions", patch_torch_functions, "it follows from the "
                         "opt level (only O1 patches torch functions)", "drop the argument")
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
        if config.patch_torch_functions:  # Apex patched torch's functions: every forward casts
            AutocastForward(device_type, config.low_dtype,
                            outputs=config.cast_model_outputs).attach(model)
    optimizer_list = [] if optimizers is None else _as_list(optimizers)
    dynamic = config.loss_scale == "dynamic"
    initial = LossScaleConfig().init_scale if dynamic else float(config.loss_scale)
    _state = _AmpState(precision=precision, scalers=[
        LossScaler(scale=initial, dynamic=dynamic, min_scale=min_loss_scale,
                   max_scale=max_loss_scale) for _ in range(num_losses)])
    for optimizer in optimizer_list:
        for model in model_list:
            precision.setup_optimizer(model, optimizer)
        _patch(optimizer, _state)
    if verbosity > 0:
        print(f"mpt.compat.apex.amp: opt_level {config.name} ({_describe(config)}), "
              f"{num_losses} loss scaler(s)", flush=True)
    return models if optimizers is None else (models, optimizers)


def _describe(config: AmpConfig) -> str:
    cast = "unchanged" if config.cast_model_type is None else str(config.cast_model_type)
    return (f"cast_model_type={cast}, autocast={config.patch_torch_functions}, "
            f"keep_batchnorm_fp32={config.keep_batchnorm_fp32}, "
            f"master_weights={config.master_weights}, loss_scale={config.loss_scale}")


def _patch(optimizer: torch.optim.Optimizer, state: _AmpState) -> None:
    precision = state.precision
    stash = state.stashes[id(optimizer)] = _Stash()
    original_step = optimizer.step
    original_zero_grad = optimizer.zero_grad
    original_load = optimizer.load_state_dict

    def step(closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise UsageError("optimizer.step", "closure", "amp does not support closures "
                             "(neither did Apex)", "compute the loss before calling step()")
        skipped, stash.skip = stash.skip, False
        if not skipped:  # else an overflow since the last step: skipped, the scale backed off
            original_step()
            precision.masters_to_model(optimizer)
        # As Apex: masters' gradients are dropped after every step, since `model.zero_grad()`
        # (DCGAN's netD.zero_grad()) does not reach them; after a skip, the inf ones too.
        for param in _stepped(optimizer):
            if precision.model_parameter(param) is not param or (
                    skipped and precision.config.master_weights):
                param.grad = None

    def zero_grad(set_to_none: bool = True) -> None:
        precision.zero_model_grads()
        original_zero_grad(set_to_none=set_to_none)

    def load_state_dict(saved: dict[str, Any]) -> None:
        original_load(saved)
        precision.sync_masters_from_model()  # as Apex: masters follow the loaded model

    optimizer.step = step  # type: ignore[method-assign]
    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]


def _stepped(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _prepare(precision: ApexPrecision, optimizer: torch.optim.Optimizer, stash: _Stash) -> None:
    """Before a backward: set aside the gradients earlier losses left, already unscaled."""
    if stash.scaled_pending:
        return  # the scaled gradients of a delayed unscale accumulate with this backward's
    stash.grads = {}
    for param in _stepped(optimizer):
        stash.grads[id(param)] = param.grad
        param.grad = None
        precision.model_parameter(param).grad = None  # under O2 the masters hold the stash


@torch.no_grad()
def _unscale(precision: ApexPrecision, optimizer: torch.optim.Optimizer, stash: _Stash,
             scale: float) -> bool:
    """After a backward: this loss's gradients, unscaled into the stepped parameters (fp32
    masters under O2), plus the stash. Returns whether any was inf or NaN."""
    stash.scaled_pending = False
    finite: list[torch.Tensor] = []
    for param in _stepped(optimizer):
        model_param = precision.model_parameter(param)
        new = model_param.grad
        model_param.grad = None
        earlier = stash.grads.get(id(param))
        if new is None:
            param.grad = earlier
            continue
        new = new.to(param.dtype) if new.dtype != param.dtype else new
        new.mul_(1.0 / scale)
        finite.append(torch.isfinite(new).all())
        param.grad = new if earlier is None else earlier.add_(new)
    stash.grads = {}
    return bool(finite) and not bool(torch.stack(finite).all())  # one wait for the device


@contextmanager
def scale_loss(loss: torch.Tensor, optimizers: Any, loss_id: int = 0,
               model: nn.Module | None = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
    """``with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()``.

    The loss is multiplied by loss ``loss_id``'s scale. On exit this backward's gradients are
    unscaled and added to those of earlier losses, unless ``delay_unscale`` (gradient
    accumulation): then they stay scaled and the next ``scale_loss`` unscales them with its own.
    An inf or NaN backs that loss's scale off and makes the optimizers skip their next step.
    """
    state = _require_state("amp.scale_loss")
    if not isinstance(loss_id, int) or not 0 <= loss_id < len(state.scalers):
        raise UsageError("loss_id", loss_id, f"amp.initialize was given num_losses="
                         f"{len(state.scalers)}", f"pass a loss_id below {len(state.scalers)}, "
                         "or raise num_losses")
    scaler = state.scalers[loss_id]
    optimizer_list = [] if optimizers is None else _as_list(optimizers)
    stashes = []
    for optimizer in optimizer_list:
        stash = state.stashes.get(id(optimizer))
        if stash is None:
            raise UsageError("optimizers", type(optimizer).__name__, "this optimizer was not "
                             "given to amp.initialize", "pass it to amp.initialize first")
        _prepare(state.precision, optimizer, stash)
        stashes.append(stash)
    yield loss.float() * scaler.scale if scaler.scale != 1.0 else loss
    if delay_unscale:
        for stash in stashes:
            stash.scaled_pending = True
        return
    overflow = False
    for optimizer, stash in zip(optimizer_list, stashes, strict=True):
        overflow |= _unscale(state.precision, optimizer, stash, scaler.scale)
    if overflow:
        for stash in stashes:
            stash.skip = True
    scaler.update(overflow)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters the optimizer steps (fp32 masters under O2), e.g. for gradient clipping."""
    yield from _stepped(optimizer)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apex's format: ``{"loss_scaler<K>": {"loss_scale": ..., "unskipped": ...}}``."""
    scalers = _require_state("amp.state_dict").scalers
    destination = {} if destination is None else destination
    for k, scaler in enumerate(scalers):
        destination[f"loss_scaler{k}"] = {"loss_scale": scaler.scale,
                                          "unskipped": scaler.unskipped}
    return destination


def load_state_dict(state: dict[str, Any]) -> None:
    """Restore the loss scalers from ``amp.state_dict()`` (Apex's or mpt's, same format)."""
    scalers = _require_state("amp.load_state_dict").scalers
    wanted = [f"loss_scaler{k}" for k in range(len(scalers))]
    if sorted(state) != sorted(wanted):
        raise UsageError("amp state", sorted(state), f"this run has {len(scalers)} loss "
                         f"scaler(s) ({', '.join(wanted)})", "pass the 'amp' entry saved by "
                         "amp.state_dict() under the same num_losses")
    for name, scaler in zip(wanted, scalers, strict=True):
        if scaler.dynamic:  # a static scale stays what this run set, as in Apex
            scaler.scale = float(state[name]["loss_scale"])
            scaler.unskipped = int(state[name].get("unskipped", 0))


__all__ = ["LossScaler", "initialize", "load_state_dict", "master_params", "scale_loss",
           "state_dict"]
