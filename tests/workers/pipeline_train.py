"""Train a 6-block nn.Sequential through rt.forward_backward; rank 0 writes OUT: the loss per
step (the batch's, as every rank gets it), the final weights by name and each rank's loss.

usage: pipeline_train.py OUT [--steps N] [--clip C] [--save-at K --ckpt DIR] [--resume DIR]
The pipeline, precision and world come from `mpt launch`; the same script runs without a
pipeline, which is what tests/distributed/test_pipeline.py compares it with. --save-at saves at
step K into DIR; --resume loads DIR's latest checkpoint and trains on (losses keyed by step).
"""

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt

GLOBAL_BATCH, FEATURES = 8, 6


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def make_data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(steps * GLOBAL_BATCH, FEATURES, generator=g),
                         torch.randn(steps * GLOBAL_BATCH, 1, generator=g))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    rt = mpt.Runtime()
    model = make_model()
    model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    replicas = rt.topology.dp_size
    loader = rt.setup_dataloader(DataLoader(make_data(args.steps), shuffle=False,
                                            batch_size=GLOBAL_BATCH // replicas // rt.accumulate))
    step = rt.load(args.resume)["step"] if args.resume else 0
    losses, norms, evals = {}, [], []
    micro: list[tuple[torch.Tensor, ...]] = []  # this step's micro-batches and their losses
    for x, y in loader:
        micro.append((x, y, rt.forward_backward(x, y, nn.functional.mse_loss)))
        if args.clip is not None:
            norm = rt.clip_grad_norm_(args.clip)
            if norm is not None:
                norms.append(norm.item())
        if rt.step():
            step += 1
            # The step's loss: the mean over its micro-batches and the replicas.
            loss = torch.stack([loss for _, _, loss in micro]).mean()
            losses[step] = rt.all_reduce(loss).item()
            if step == args.save_at:
                rt.save(args.ckpt, step=step)
            evaluated = torch.stack([rt.evaluate(x, y, nn.functional.mse_loss)
                                     for x, y, _ in micro]).mean()
            evals.append(rt.all_reduce(evaluated).item())
            micro = []
    weights = rt.backend.model_state_dict(model)
    if rt.rank == 0:
        args.out.write_text(json.dumps({
            "losses": losses, "norms": norms, "evals": evals, "scale": rt.precision.loss_scale,
            "weights": {k: v.float().flatten().tolist() for k, v in weights.items()}}))
    rt.close()
