"""Train with Adam + StepLR on a shuffled, sharded dataset; save mid-epoch or resume from saves.

usage: ckpt_resume.py OUT TAG SAVE_AT SAVE_ROOT [CKPT ...]
Without CKPT: train from scratch for STEPS steps (run TAG). With CKPTs: for each one in turn,
load it and continue to STEPS (runs TAG-0, TAG-1, ...). When the first run reaches step SAVE_AT it
saves SAVE_ROOT/full and SAVE_ROOT/sharded (sharded=True). Each rank writes OUT/<run>-rank<r>.json:
the global loss and this rank's sample indices per step, and RNG draws made right after the save
(or load), which a resumed run must repeat.
"""

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
from common import FEATURES, make_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt

SAMPLES, GLOBAL_BATCH, STEPS = 48, 8, 15  # 6 steps per epoch

out, tag, save_at, save_root = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
checkpoints = sys.argv[5:]
rt = mpt.Runtime()
g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g),
                     torch.randn(SAMPLES, 1, generator=g), torch.arange(SAMPLES))
model = make_model()
model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
loader = rt.setup_dataloader(DataLoader(data, batch_size=GLOBAL_BATCH // rt.world_size,
                                        shuffle=True))


def draws() -> list[float]:
    return [torch.rand(1).item(), float(np.random.rand()), random.random()]


def train(step: int, log: dict, save: bool) -> None:
    while step < STEPS:
        for x, y, idx in loader:
            loss = nn.functional.mse_loss(model(x), y)
            rt.backward(loss)
            rt.step()
            scheduler.step()
            step += 1
            log["loss"][step] = rt.all_reduce(loss.detach().clone()).item()
            log["idx"][step] = idx.tolist()
            if save and step == save_at:
                rt.save(f"{save_root}/full", step=step, scheduler=scheduler, note="mid-epoch")
                rt.save(f"{save_root}/sharded", step=step, scheduler=scheduler, sharded=True,
                        note="mid-epoch")
                log["saved_draws"] = draws()
            if step == STEPS:
                break


runs = [(tag, None)] if not checkpoints else [(f"{tag}-{i}", c) for i, c in enumerate(checkpoints)]
for i, (run, ckpt) in enumerate(runs):
    log: dict = {"loss": {}, "idx": {}, "world_size": rt.world_size}
    start = 0
    if ckpt is not None:
        info = rt.load(ckpt, scheduler=scheduler)
        log["loaded_draws"], log["info"] = draws(), info
        log["lr"] = scheduler.get_last_lr()
        start = info["step"]
    train(start, log, save=i == 0)
    log["params"] = [p.detach().flatten().tolist() for p in rt.backend.unwrap(model).parameters()]
    (out / f"{run}-rank{rt.rank}.json").write_text(json.dumps(log))
rt.close()
