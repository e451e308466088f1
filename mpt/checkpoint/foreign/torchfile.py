"""A ``torch.save`` file of a plain torchrun, Horovod or Apex script.

Such a script saves ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), ...}``
(or the state dict alone): weights keyed ``module.<name>`` when taken from a DDP wrapper, the
optimizer's state numbered in the order the optimizer holds its parameters, apex amp's loss
scale under ``amp``, maybe an LR scheduler, a GradScaler, the step and the epoch. The numbers
become names the way torch gives them: a script that builds its optimizer from
``model.parameters()`` numbers the parameters in the order of the model's state dict, which
lists them with its buffers; the buffers (BatchNorm's running statistics, integer counters)
are left out, and the result is checked against every moment's shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mpt.checkpoint.foreign import optimizer as optim
from mpt.checkpoint.foreign import torchload
from mpt.checkpoint.foreign.imported import Imported, as_int
from mpt.errors import UsageError
from mpt.precision import LossScaleState

_MODEL = ("model", "state_dict", "model_state_dict", "model_state", "net")
_OPTIMIZER = ("optimizer", "optimizer_state_dict", "optim")
_SCHEDULER = ("lr_scheduler", "scheduler", "scheduler_state_dict")
_STEP = ("step", "global_step", "iteration")
_SCALER = ("scaler", "grad_scaler")
_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
"""The buffers torch's normalization layers keep beside their parameters."""


def read(src: Path, *, optimizer: bool = True) -> Imported:
    """The training state in torch file ``src`` (its optimizer's where ``optimizer``)."""
    loaded = torchload.load(src)
    if not isinstance(loaded, Mapping):
        raise UsageError("SRC", src, f"it holds a {type(loaded).__name__}, not a dict",
                         "pass a state dict, or a dict with a 'model' state dict")
    model = _first(loaded, _MODEL)
    if model is None and all(isinstance(v, torch.Tensor) for v in loaded.values()):
        model = loaded  # the model's state dict alone
    weights = {k: v for k, v in (model or {}).items() if isinstance(v, torch.Tensor)}
    if not weights:
        raise UsageError("SRC", src, f"it holds no tensors under {', '.join(_MODEL)} or at the "
                         "top", "pass a state dict of tensors")
    if all(k.startswith("module.") for k in weights):  # saved from a DDP or apex DDP wrapper
        weights = {k.removeprefix("module."): v for k, v in weights.items()}
    named, kind = None, None
    saved = _first(loaded, _OPTIMIZER)
    # no param groups: an optimizer that was never set up, nothing to import
    if optimizer and isinstance(saved, Mapping) and saved.get("param_groups"):
        named = optim.named_from_numbered(saved, _parameter_names(weights, saved, str(src)),
                                         str(src))
        named, kind = optim.as_torch(named, str(src))
        optim.check_shapes(named, {k: t.shape for k, t in weights.items()}, str(src))
    loss_scale = _loss_scale(loaded)
    return Imported(source="torch.save file", weights=weights, optimizer=named,
                    optimizer_kind=kind, scheduler=_first(loaded, _SCHEDULER),
                    loss_scale=loss_scale,
                    precision="fp32" if loss_scale is None else "fp16-mixed",
                    step=as_int(_first(loaded, _STEP)), epoch=as_int(loaded.get("epoch")))


def _first(loaded: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((loaded[key] for key in keys if key in loaded), None)


def _parameter_names(weights: dict[str, torch.Tensor], saved: Mapping[str, Any], where: str
                     ) -> list[str]:
    """The name of each numbered parameter: the groups' own ``param_names`` where the
    optimizer was built from ``named_parameters()``, else the model's floating-point tensors
    in state-dict order but the normalization layers' running statistics."""
    groups = saved.get("param_groups") or []
    if groups and all("param_names" in group for group in groups):
        return [name.removeprefix("module.") for group in groups for name in group["param_names"]]
    optim.in_model_order(groups, where)
    return [name for name, t in weights.items()
            if t.is_floating_point() and not name.endswith(_BUFFERS)]


def _loss_scale(loaded: Mapping[str, Any]) -> LossScaleState | None:
    """apex amp's (``amp.state_dict()``: ``loss_scaler0``...) or a GradScaler's loss scale."""
    amp = loaded.get("amp")
    if isinstance(amp, Mapping):
        scaler = next((v for k, v in amp.items() if k.startswith("loss_scaler")), None)
        if isinstance(scaler, Mapping):
            return LossScaleState(scale=float(scaler["loss_scale"]),
                                  clean_steps=int(scaler.get("unskipped", 0)))
    scaler = _first(loaded, _SCALER)
    if isinstance(scaler, Mapping) and "scale" in scaler:
        return LossScaleState.from_state_dict(scaler)
    return None

