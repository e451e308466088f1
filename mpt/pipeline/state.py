"""A pipelined model's state as checkpoints see it: the whole model's, whichever stage holds it.

Checkpoints talk to a ``StateHolder`` (``mpt.checkpoint.state``). Without a pipeline that is the
backend; with one it is ``StagedState``, which asks the backend for this rank's stage and merges
the stages: whole state dicts gathered over the stages of a replica, sharded ones left as each
rank holds them (no gather), and a parameter that stages share always named by its owner.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from mpt.errors import UsageError
from mpt.pipeline.stages import Stages


class StagedState:
    """The ``StateHolder`` of a pipelined run: ``stages``' backend, state merged over stages."""

    shards_state: ClassVar[bool] = True
    """Each rank holds its stage only (under fsdp, its shards of it): a sharded checkpoint
    takes every stage's pieces from the ranks holding them and gathers nothing."""

    def __init__(self, stages: Stages) -> None:
        self.stages = stages
        self.backend = stages.backend
        self.name, self.world, self.precision = (self.backend.name, self.backend.world,
                                                 self.backend.precision)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.backend.unwrap(model)

    # -- whole state: every stage's, merged --------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        local = self.backend.model_state_dict(model)  # this stage's, whole
        merged: dict[str, torch.Tensor] = {}
        for part in self.stages.gather({k: v.detach().cpu() for k, v in local.items()}):
            merged.update(part)
        return merged

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        """This stage's keys of ``state`` (the whole model's, or a sharded checkpoint's read in
        part: the other stages' left unread) into the stage."""
        own = model.state_dict().keys()
        missing = sorted(set(own) - set(state))
        if missing:
            raise UsageError("checkpoint", ", ".join(missing[:3]), "it has no weights for "
                             "these parameters of this stage", "load it into the model it was "
                             "saved from")
        self.backend.load_model_state_dict(model, {k: state[k] for k in own})

    def optimizer_state_dict(self, model: nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        local = _renamed(self.backend.optimizer_state_dict(model, optimizer),
                         self.stages.aliases)
        parts = self.stages.gather(local)
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        for part in parts:
            merged["state"].update(part["state"])
        for index, group in enumerate(parts[0]["param_groups"]):
            names = [name for part in parts for name in part["param_groups"][index]["params"]]
            merged["param_groups"].append({**group, "params": list(dict.fromkeys(names))})
        return merged

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """The state of this stage's parameters in ``state`` (the whole model's), the others'
        dropped."""
        aliases = self.stages.aliases
        own = {aliases.get(name, name)
               for name in self.backend.parameter_names(model, optimizer)}
        mine = {"state": {k: v for k, v in state["state"].items() if k in own},
                "param_groups": [{**group, "params": [n for n in group["params"] if n in own]}
                                 for group in state["param_groups"]]}
        owners = {owner: name for name, owner in aliases.items()}
        self.backend.load_optimizer_state_dict(model, optimizer, _renamed(mine, owners))

    # -- this rank's pieces: the backend's, of its stage --------------------------------------
    def local_model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The backend's state of this rank's stage: its ``DTensor`` shards under fsdp, its
        whole tensors under ddp (which the stage's replicas hold alike), under the whole
        model's names (a ``Stage`` keeps them)."""
        return self.backend.local_model_state_dict(model)

    def local_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                   *, create: bool = False) -> dict[str, Any]:
        """The backend's optimizer state of this rank's stage, named as
        ``optimizer_state_dict`` names it: a parameter that stages share by its owner's name,
        on every stage that holds it."""
        local = self.backend.local_optimizer_state_dict(model, optimizer, create=create)
        return _renamed(local, self.stages.aliases)

    def comm_state_dict(self, model: nn.Module) -> list[dict[str, Any]]:
        return self.backend.comm_state_dict(model)

    def load_comm_state_dict(self, model: nn.Module, states: list[dict[str, Any]]) -> None:
        self.backend.load_comm_state_dict(model, states)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.backend.broadcast_object(obj, src)

    def barrier(self) -> None:
        self.backend.barrier()


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """An optimizer state by parameter name (``mpt.state.named``), its names mapped by
    ``names`` (those it lacks kept)."""
    return {"state": {names.get(k, k): v for k, v in state["state"].items()},
            "param_groups": [{**group, "params": [names.get(n, n) for n in group["params"]]}
                             for group in state["param_groups"]]}
