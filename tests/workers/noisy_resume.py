"""Train a model whose step draws from torch's global generator (dropout, ``torch.randn`` noise,
as a GAN's generator input), save mid-epoch, or resume from that save.

usage: noisy_resume.py OUT TAG SAVE_AT CKPT_ROOT [--resume]
Rank 0 writes OUT/TAG.json: the global loss per step. With --resume the run loads CKPT_ROOT's
latest checkpoint and trains on to STEPS; without, it trains from scratch and saves at SAVE_AT.
A resumed run lies on the uninterrupted run's curve only if nothing but the script draws from
the global generator: the loaders mpt sets up draw from generators of their own.
"""

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt

SAMPLES, GLOBAL_BATCH, STEPS = 48, 8, 10  # 6 steps per epoch: saves and resumes mid-epoch

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("tag")
parser.add_argument("save_at", type=int)
parser.add_argument("ckpt")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

rt = mpt.Runtime()
g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
loader = rt.setup_dataloader(DataLoader(data, batch_size=GLOBAL_BATCH // rt.world_size,
                                        shuffle=True))
torch.manual_seed(100 + rt.rank)  # each rank its own noise, as a GAN's would be
step = rt.load(args.ckpt)["step"] if args.resume else 0
losses: dict[int, float] = {}
while step < STEPS:
    for x, y in loader:
        noise = torch.randn_like(x) * 0.1  # drawn after the loader's next(): shifts if it draws
        with rt.autocast():
            loss = nn.functional.mse_loss(model(x + noise), y)
        rt.backward(loss)
        rt.step()
        step += 1
        losses[step] = rt.all_reduce(loss.detach().clone()).item()
        if not args.resume and step == args.save_at:
            rt.save(args.ckpt, step=step)
        if step == STEPS:
            break
if rt.rank == 0:
    (args.out / f"{args.tag}.json").write_text(json.dumps(losses))
rt.close()
