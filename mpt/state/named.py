"""Optimizer state keyed by parameter name instead of by position.

torch's ``optimizer.state_dict()`` numbers parameters in the order the optimizer holds them, an
order that changes with the backend (DeepSpeed flattens, O2 keeps master copies) and with the
model code. Keyed by the name ``module.named_parameters()`` gives, the state survives both::

    {"state": {"fc.weight": {"step": 3.0, "exp_avg": tensor, ...}, ...},
     "param_groups": [{"lr": 0.1, "betas": [0.9, 0.999], ..., "params": ["fc.weight", ...]}]}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpt.errors import UsageError


def to_named(state_dict: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each parameter index replaced by ``names[index]``."""
    return {
        "state": {names[index]: dict(value) for index, value in state_dict["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                         for group in state_dict["param_groups"]],
    }


def from_named(named: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The ``optimizer.state_dict()`` for an optimizer whose parameters are called ``names``.

    Groups are matched by position; each group's parameters must be the same set of names.
    """
    index = {name: i for i, name in enumerate(names)}
    missing = sorted(set(names) - {n for g in named["param_groups"] for n in g["params"]})
    if missing or len(index) != len(names):
        raise UsageError("checkpoint", ", ".join(missing[:3]) or "duplicate names",
                         "the checkpoint's optimizer has no state for these parameters",
                         "load it into the model it was saved from")
    unknown = sorted(n for g in named["param_groups"] for n in g["params"] if n not in index)
    if unknown:
        raise UsageError("checkpoint", ", ".join(unknown[:3]),
                         "the model has no parameters with these names",
                         "load it into the model it was saved from")
    return {
        "state": {index[name]: value for name, value in named["state"].items()},
        # torch pairs saved and current parameters by position, so each group lists its
        # parameters in the order the current optimizer holds them.
        "param_groups": [{**group, "params": sorted(index[n] for n in group["params"])}
                         for group in named["param_groups"]],
    }
