"""Train a small examples/gpt.py GPT through rt.forward_backward with clipping; rank 0 writes
OUT (JSON): the loss of every step (averaged over the data-parallel ranks: the global
batch's), and every rank's count of the parameter, gradient and optimizer-state elements it
holds.

usage: tensor_parallel.py OUT [--steps N] [--save-at K --ckpt DIR] [--resume DIR]
       [--no-plan] [--plan-name NAME] [--overflow-at K] [--sequence-parallel]
Layout, backend and precision come from `mpt launch`; tests/distributed/test_tensor_parallel.py
compares the losses with the same loop in plain torch on one process (``reference``).
--no-plan removes the model's tensor_parallel_plan(); --plan-name adds a planned module of that
name. --overflow-at K makes rank 0's gradients of step K non-finite (fp16 runs).
--sequence-parallel trains ``SequenceNet`` instead, whose plan splits its norms over the sequence.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig, next_token_loss

import mpt

CONFIG = GPTConfig(vocab=61, block=16, layers=2, heads=4, embed=64)
GLOBAL_BATCH, CLIP, LR = 8, 0.5, 3e-3


class SequenceNet(nn.Module):
    """Embedding, norm, MLP, norm, head: the plan torchtitan gives a transformer's edges, with
    the norms sequence-parallel (each tp rank normalises its part of the sequence) and the
    activations between them sharded over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        width = CONFIG.embed
        self.embed = nn.Embedding(CONFIG.vocab + 3, width)  # rows: a multiple of 2 and 4
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head = nn.Linear(width, CONFIG.vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        x = x + self.down(nn.functional.gelu(self.up(self.norm1(x))))
        return self.head(self.norm2(x))

    def tensor_parallel_plan(self) -> dict[str, object]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm1": "sequence", "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1)), "norm2": "sequence",
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}


def make_model(sequence: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return GPT(CONFIG) if not sequence else SequenceNet()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def make_data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab, (steps * GLOBAL_BATCH, CONFIG.block + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def reference(steps: int, sequence: bool = False) -> list[float]:
    """The same loop in plain torch on one process: the loss of every step."""
    model = make_model(sequence)
    optimizer = make_optimizer(model)
    losses = []
    for x, y in DataLoader(make_data(steps), batch_size=GLOBAL_BATCH):
        loss = next_token_loss(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def local_numel(tensor: torch.Tensor) -> int:
    return getattr(tensor, "to_local", lambda: tensor)().numel()


def whole_sum(model: nn.Module) -> float:
    """A checksum of the weights this rank holds whole (those no axis splits)."""
    whole = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()
             if all(placement.is_replicate() for placement in getattr(p, "placements", ()))]
    return sum(float(p.double().sum()) for p in whole)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--no-plan", action="store_true")
    parser.add_argument("--plan-name", default=None)
    parser.add_argument("--overflow-at", type=int, default=None)
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    rt = mpt.Runtime()
    model = make_model(args.sequence_parallel)
    if args.no_plan:
        model.tensor_parallel_plan = None  # type: ignore[method-assign,assignment]
    if args.plan_name:
        planned = model.tensor_parallel_plan()
        model.tensor_parallel_plan = lambda: {**planned, args.plan_name: "colwise"}  # type: ignore[method-assign]
    model, optimizer = rt.setup(model, make_optimizer(model))
    loader = rt.setup_dataloader(DataLoader(make_data(args.steps),
                                            batch_size=GLOBAL_BATCH // rt.topology.dp_size))
    step = rt.load(args.resume)["step"] if args.resume else 0
    losses: dict[int, float] = {}
    for x, y in loader:  # a resumed loader goes on from the saved position
        loss = rt.forward_backward(x, y, next_token_loss)
        if args.overflow_at == step + 1 and rt.rank == 0:
            next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))
        rt.clip_grad_norm_(CLIP)
        rt.step()
        step += 1
        losses[step] = rt.all_reduce(loss.clone()).item()
        if step == args.save_at:
            rt.save(args.ckpt, step=step)
    held = {"params": sum(local_numel(p) for p in model.parameters()),
            "state": sum(local_numel(v) for s in optimizer.state.values()
                         for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
            "skipped": getattr(rt.precision, "skipped_steps", 0),
            "scale": rt.precision.loss_scale,
            "whole_sum": whole_sum(model)}
    every = [held]
    if rt.world_size > 1:
        every = [{} for _ in range(rt.world_size)]
        torch.distributed.all_gather_object(every, held)
    if rt.rank == 0:
        whole = sum(p.numel() for p in make_model(args.sequence_parallel).parameters())
        args.out.write_text(json.dumps({"losses": losses, "held": every, "whole": whole}))
    rt.close()


if __name__ == "__main__":
    main()
