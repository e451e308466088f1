"""State of a model whose parameters are DTensors (fsdp's shards, tensor-parallel layers), by
the names of the user's module: torch.distributed.checkpoint's state_dict API, whole on every
rank or as each rank's shards.

Imported when used: torch.distributed.checkpoint adds ~0.4 s to every `mpt` command otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpt.backends.base import holds


def model_state(model: nn.Module, *, full: bool) -> dict[str, torch.Tensor]:
    """Whole weights (``full``: gathered, every rank calls), or the DTensor shards themselves
    (no copy)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full=full))


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load whole weights (each rank keeps its part) or shards read in place."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.tensor import DTensor

    set_model_state_dict(model, state, options=_options(full=not holds(DTensor, state)))


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool,
                    create: bool) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (the layout of ``mpt.state.named``), whole
    or this rank's shards. torch makes a fresh optimizer's state on the way (one step at lr 0,
    Adam's step count 1): kept where ``create`` asks for it (a load reads into it), dropped
    otherwise, so that a resumed run starts fresh as well."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fresh = not optimizer.state
    state = get_optimizer_state_dict(model, optimizer, options=_options(full=full))
    if fresh and not create:
        optimizer.state.clear()
        state["state"] = {}
    return state


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:
    """Restore what ``optimizer_state`` returned (whole, or shards read in place)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    if not _holds_tensors(state["state"]):
        # No tensor per parameter (saved before the first step, or plain SGD): torch's loader
        # needs one to find the device by. The hyper-parameters load, and the state is as
        # fresh as it was saved.
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        optimizer.state.clear()
        return
    set_optimizer_state_dict(model, optimizer, state, options=_options(
        full=not holds(DTensor, state["state"])))


def _holds_tensors(state: dict[str, Any]) -> bool:
    """Whether an optimizer's per-parameter state holds a tensor of one element or more."""
    return any(isinstance(value, torch.Tensor) and value.dim() > 0
               for per_param in state.values() for value in per_param.values())


def _options(*, full: bool) -> Any:
    """Whole tensors on every rank (what a checkpoint that is not sharded holds), or shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full)
