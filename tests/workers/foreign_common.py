"""What the plain DeepSpeed, FSDP2 and torch scripts and the mpt script that resumes their
checkpoints share: the data, the optimizer, the warm-up schedule and the training loop, so that
their curves can be compared step for step; and how the plain scripts save and resume."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import FEATURES, make_model
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

GLOBAL_BATCH = 8
CLIP = 1.0
"""Gradients are clipped to this norm: DeepSpeed's default (``gradient_clipping``)."""


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of every step (the same in every script and world size)."""
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(GLOBAL_BATCH, FEATURES, generator=g),
             torch.randn(GLOBAL_BATCH, 1, generator=g)) for _ in range(steps)]


def rank_slice(rank: int, world_size: int) -> slice:
    """Rank ``rank``'s rows of a global batch: equal slices, so the mean of the ranks' mean
    losses (and gradients) is the whole batch's."""
    size = GLOBAL_BATCH // world_size
    return slice(rank * size, (rank + 1) * size)


def make_split_model() -> nn.Module:
    """``common.make_model``, declaring how ``--tensor-parallel`` splits it (read only there):
    the first layer by its outputs, the last by its inputs."""
    model = make_model()
    model.tensor_parallel_plan = lambda: {"0": "colwise", "2": "rowwise"}
    return model


def make_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def make_warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warm-up over 6 steps, then constant: the LR still grows after a save at 3."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 6))


def continue_in_mpt(rt: Any, scheduler: Any, start: int, steps: int) -> dict[int, float]:
    """Train an mpt run (``rt``, with the model and optimizer ``rt.setup`` made) from step
    ``start`` to ``steps`` as the plain scripts do; every step's loss over the global batch."""
    losses = {}
    for step, (x, y) in enumerate(batches(steps), start=1):
        if step <= start:
            continue
        # the data-parallel replicas' rows: tensor-parallel ranks and pipeline stages of one
        # replica read the same rows
        part = rank_slice(rt.topology.dp_rank, rt.topology.dp_size)
        loss = rt.forward_backward(x[part], y[part], _mse)
        rt.clip_grad_norm_(CLIP)
        rt.step()
        scheduler.step()
        losses[step] = rt.all_reduce(loss.clone()).item()
    return losses


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.float(), target)


Saver = Callable[[nn.Module, torch.optim.Optimizer, Any, int], None]
Loader = Callable[[nn.Module, torch.optim.Optimizer, Any], int]


def plain_run(model: nn.Module, steps: int, save_at: int = 0, save: Saver | None = None,
              load: Loader | None = None) -> dict[int, float]:
    """A plain torch script (no mpt) with the process group torch.distributed has, if any:
    train ``model`` (wrapped in DDP or sharded by FSDP2 already, or not) to step ``steps``,
    each rank on its slice of the global batches, calling ``save(model, optimizer, scheduler,
    step)`` after step ``save_at`` as a script saves its checkpoint, or first ``load(model,
    optimizer, scheduler)``, which restores one and returns its step; each step's loss over
    the global batch."""
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    optimizer = make_adamw(model)
    scheduler = make_warmup(optimizer)
    start = 0 if load is None else load(model, optimizer, scheduler)
    losses = {}
    for step, (x, y) in enumerate(batches(steps), start=1):
        if step <= start:
            continue
        part = rank_slice(rank, world)
        loss = nn.functional.mse_loss(model(x[part]), y[part])
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if distributed:
            dist.all_reduce(total)
        losses[step] = total.item() / world
        if step == save_at and save is not None:
            save(model, optimizer, scheduler, step)
    return losses


def save_torch(path: Path) -> Saver:
    """What a torchrun or Horovod script's rank 0 saves: one torch.save file."""
    def save(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             step: int) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "step": step, "epoch": 0}, path)
    return save


def load_torch(path: Path) -> Loader:
    """How such a script resumes from its torch.save file."""
    def load(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        return saved["step"]
    return load


def save_dcp(path: Path) -> Saver:
    """What a plain FSDP2 or DDP script saves with torch.distributed.checkpoint."""
    def save(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             step: int) -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer)  # collective
        dcp.save({"model": model_state, "optimizer": optimizer_state,
                  "lr_scheduler": scheduler.state_dict(),
                  "train_state": {"step": step, "epoch": 0}}, checkpoint_id=str(path))
    return save


def load_dcp(path: Path) -> Loader:
    """How such a script resumes: ``dcp.load`` into ``get_state_dict``'s state (which has
    the optimizer's moments, made by a step of zero gradients), then ``set_state_dict``."""
    def load(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state,
                 "lr_scheduler": scheduler.state_dict(), "train_state": {"step": 0, "epoch": 0}}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        scheduler.load_state_dict(state["lr_scheduler"])
        return state["train_state"]["step"]
    return load
