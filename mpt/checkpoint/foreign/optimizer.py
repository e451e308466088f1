"""A foreign optimizer state made into the by-name form of mpt's checkpoints (``mpt.state.named``).

Frameworks number parameters (torch's ``optimizer.state_dict()``), flatten them (DeepSpeed) or
name them already (``get_state_dict``). Whatever the source, the result is torch's own state of
the optimizer class it came from, keyed by parameter name, with ``step`` per parameter as torch
keeps it; so ``optimizer.load_state_dict`` of that class in the mpt run takes it as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mpt.errors import UsageError
from mpt.state.named import to_named

_TORCH_ADAM = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None}
"""What torch's Adam/AdamW keep in a param group beside lr, betas, eps and weight decay."""


GROUPS_UNNAMED = ("its optimizer has {n} param groups and no parameter names: torch numbers "
                  "parameters in group order, which need not be the model's")
"""Why numbered state of several groups cannot be named by the model's order."""
GROUPS_FIX = ("build the optimizer from named_parameters() (its groups then hold param_names), "
              "or convert with --weights-only")


def in_model_order(groups: Sequence[Mapping[str, Any]], where: str) -> None:
    """Refuse numbered state of several param groups named by the model's order: torch numbers
    the parameters group by group, and groups in another order than the model's would give one
    parameter's moments (and its group's learning rate) to another of the same shape."""
    if len(groups) > 1:
        raise UsageError("SRC", where, GROUPS_UNNAMED.format(n=len(groups)), GROUPS_FIX)


def named_from_numbered(state_dict: Mapping[str, Any], names: Sequence[str], where: str
                        ) -> dict[str, Any]:
    """torch's numbered ``optimizer.state_dict()`` keyed by ``names`` (the parameter of index
    i is ``names[i]``: torch numbers them in param-group order)."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not isinstance(state_dict.get("state"), Mapping):
        raise UsageError("SRC", where, "its optimizer entry is not an optimizer.state_dict() "
                         "(no 'state' and 'param_groups')", "save optimizer.state_dict(), or "
                         "convert with --weights-only")
    count = sum(len(group["params"]) for group in groups)
    if count != len(names):
        raise UsageError("SRC", where, f"its optimizer holds {count} parameters and its model "
                         f"{len(names)}: which state belongs to which parameter cannot be told",
                         "convert with --weights-only, or save the optimizer by parameter name "
                         "(torch.distributed.checkpoint.state_dict.get_optimizer_state_dict)")
    return to_named(dict(state_dict), names)


def as_torch(named: dict[str, Any], where: str) -> tuple[dict[str, Any], str | None]:
    """``named`` as the torch optimizer class it is from keeps it, and that class's name (None
    where the groups do not tell): DeepSpeed's own Adam (``adam_w_mode``) becomes torch's
    Adam/AdamW, a ``step`` kept per group or as a number becomes torch's per-parameter tensor."""
    groups, kind = [], None
    for group in named["param_groups"]:
        group, kind = _torch_group(dict(group), where)
        groups.append(group)
    steps = {name: step for group, raw in zip(groups, named["param_groups"], strict=True)
             for name in group["params"] if (step := raw.get("step")) is not None}
    state = {}
    for name, value in named["state"].items():
        value = dict(value)
        step = value.get("step", steps.get(name))
        if step is not None:  # torch's Adam and AdamW keep it as a float32 tensor per parameter
            value["step"] = torch.tensor(float(step), dtype=torch.float32)
        state[name] = value
    return {"state": state, "param_groups": groups}, kind


def _torch_group(group: dict[str, Any], where: str) -> tuple[dict[str, Any], str | None]:
    group.pop("step", None)  # moved into each parameter's state
    if "adam_w_mode" in group:  # DeepSpeed's FusedAdam / DeepSpeedCPUAdam
        if not group.pop("bias_correction", True):
            raise UsageError("SRC", where, "its Adam ran without bias correction, which torch's "
                             "Adam always applies", "convert with --weights-only")
        decoupled = bool(group.pop("adam_w_mode"))
        return {**_TORCH_ADAM, **group, "decoupled_weight_decay": decoupled}, \
            "AdamW" if decoupled else "Adam"
    if "betas" in group and "decoupled_weight_decay" in group:
        return group, "AdamW" if group["decoupled_weight_decay"] else "Adam"
    if "momentum" in group and "nesterov" in group:
        return group, "SGD"
    return group, None


def check_shapes(named: Mapping[str, Any], shapes: Mapping[str, torch.Size], where: str) -> None:
    """Refuse optimizer state whose parameter names are not the model's, or whose tensors
    are not one value per element of their parameter (another kind of optimizer than those
    whose state converts: Adam, AdamW, SGD, ... keep per-element moments)."""
    names = [name for group in named["param_groups"] for name in group["params"]]
    unknown = [name for name in names if name not in shapes]
    if unknown:
        raise UsageError("SRC", where, f"its optimizer names parameters its model lacks: "
                         f"{', '.join(unknown[:3])} (the model has "
                         f"{', '.join(list(shapes)[:3])}, ...)", "convert with --weights-only")
    wrong = [f"{name}/{key} {tuple(value.shape)} (parameter {tuple(shapes[name])})"
             for name, entry in named["state"].items() for key, value in entry.items()
             if isinstance(value, torch.Tensor) and value.dim() > 0
             and value.shape != shapes.get(name, value.shape)]
    if wrong:
        raise UsageError("SRC", where, f"its optimizer state is not one value per parameter "
                         f"element: {'; '.join(wrong[:3])}", "convert with --weights-only (an "
                         "optimizer of another kind than Adam, AdamW, SGD, ... is not converted)")
