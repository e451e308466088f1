"""What a backend whose ranks hold pieces of the state (fsdp, ZeRO-3) writes and reads back.

usage: mpt launch --gpus 2 --backend fsdp --fsdp-wrap Linear | --backend deepspeed --zero-stage 3
       shard_pieces.py OUT_DIR

fp32 Adam on Linear(256, 256), Linear(256, 7) (rows that straddle the ranks' ranges), a frozen
bias and two param groups, 3 steps on batches fixed by step and rank. Saved before the first
step and after step 2; step 3 changes every weight and moment; the step-2 checkpoint is
loaded: each rank must get its own pieces back. Then the step-0 checkpoint is loaded and steps
1-2 run again: the optimizer must start fresh, as it did, and land on the same weights.
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import mpt
from mpt.state.flat import FlatPiece

out = Path(sys.argv[1])


def pieces(state: dict) -> list[torch.Tensor]:
    """This rank's pieces in ``state`` (nested), copied."""
    found = []
    for value in state.values():
        if isinstance(value, dict):
            found += pieces(value)
        elif isinstance(value, DTensor):
            found.append(value.to_local().clone())
        elif isinstance(value, FlatPiece):
            found.append(value.flat.clone())
    return found


rt = mpt.Runtime(quiet=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 7))
model[0].bias.requires_grad_(False)
model, optimizer = rt.setup(model, torch.optim.Adam([
    {"params": [model[0].weight]}, {"params": model[2].parameters(), "lr": 0.02}], lr=0.01))


def train(first: int, last: int) -> None:
    for step in range(first, last + 1):
        torch.manual_seed(100 + 10 * step + rt.rank)
        with rt.autocast():
            loss = model(torch.randn(8, 256)).float().square().mean()
        rt.backward(loss)
        rt.step()


def weights() -> list[torch.Tensor]:
    return pieces(rt.backend.local_model_state_dict(model))


def moments() -> list[torch.Tensor]:
    return pieces(rt.backend.local_optimizer_state_dict(model, optimizer))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


fresh = rt.save(out / "ckpt", step=0)
train(1, 2)
saved_weights, saved_moments = weights(), moments()
where = rt.save(out / "ckpt", step=2)
train(3, 3)
changed = not same(weights(), saved_weights) and not same(moments(), saved_moments)
rt.load(where)
result = {"rank": rt.rank, "where": where, "changed": changed,
          "weights_back": same(weights(), saved_weights),
          "moments_back": same(moments(), saved_moments),
          "local_bytes": 4 * sum(t.numel() for t in saved_weights + saved_moments)}
rt.load(fresh)
result["fresh_state"] = rt.backend.local_optimizer_state_dict(model, optimizer)["state"] == {}
train(1, 2)
result["fresh_resumes"] = same(weights(), saved_weights)
rt.close()
(out / f"rank{result['rank']}.json").write_text(json.dumps(result))
