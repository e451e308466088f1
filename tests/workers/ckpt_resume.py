"""Train with Adam + StepLR on a shuffled, sharded dataset; save mid-epoch or resume from saves.

usage: ckpt_resume.py OUT TAG SAVE_AT SAVE_ROOT [CKPT ...] [--full-only]
Without CKPT: train from scratch for STEPS steps (run TAG). With CKPTs: for each one in turn,
load it and continue to STEPS (runs TAG-0, TAG-1, ...). When the first run reaches step SAVE_AT it
saves SAVE_ROOT/full and (unless --full-only) SAVE_ROOT/sharded (sharded=True). Each rank writes
OUT/<run>-rank<r>.json: the global loss, the loss scale and this rank's sample indices per step,
RNG draws made right after the save (or load), which a resumed run must repeat, and the final
full weights. The backend and precision come from `mpt launch`, so the same script makes every
row of the save-under-A, load-under-B matrix. fp16 precisions start at scale 1024 and grow it
every 3 clean steps: the scale changes within 15 steps, so a resumed run that lost the scaler's
state (scale or growth tracker) grows it at other steps.
"""

import argparse
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
from mpt.precision import LossScaleConfig

SAMPLES, GLOBAL_BATCH, STEPS = 48, 8, 15  # 6 steps per epoch

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("tag")
parser.add_argument("save_at", type=int)
parser.add_argument("save_root")
parser.add_argument("checkpoints", nargs="*")
parser.add_argument("--full-only", action="store_true")
args = parser.parse_args(sys.argv[1:])
out, tag, save_at, save_root, checkpoints = (args.out, args.tag, args.save_at, args.save_root,
                                             args.checkpoints)
rt = mpt.Runtime(loss_scale=LossScaleConfig(init_scale=1024.0, growth_interval=3))
g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g),
                     torch.randn(SAMPLES, 1, generator=g), torch.arange(SAMPLES))
model = make_model()
model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
# On what setup returned, as a script would write it, whichever the backend.
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
loader = rt.setup_dataloader(DataLoader(data, batch_size=GLOBAL_BATCH // rt.world_size,
                                        shuffle=True))


def draws() -> list[float]:
    return [torch.rand(1).item(), float(np.random.rand()), random.random()]


def masters() -> list[list[float]]:
    """O2's fp32 master weights (none for other precisions), as checkpoints keep them: the
    model's weights."""
    if rt.precision.spec.master == rt.precision.spec.params:
        return []
    return [t.flatten().tolist() for t in rt.backend.model_state_dict(model).values()]


def train(step: int, log: dict, save: bool) -> None:
    while step < STEPS:
        for x, y, idx in loader:
            with rt.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            rt.backward(loss)
            rt.step()
            scheduler.step()
            step += 1
            log["loss"][step] = rt.all_reduce(loss.detach().clone()).item()
            log["idx"][step] = idx.tolist()
            log["scale"][step] = rt.precision.loss_scale
            if save and step == save_at:
                rt.save(f"{save_root}/full", step=step, scheduler=scheduler, note="mid-epoch")
                if not args.full_only:
                    rt.save(f"{save_root}/sharded", step=step, scheduler=scheduler, sharded=True,
                            note="mid-epoch")
                log["saved_draws"], log["saved_masters"] = draws(), masters()
            if step == STEPS:
                break


runs = [(tag, None)] if not checkpoints else [(f"{tag}-{i}", c) for i, c in enumerate(checkpoints)]
for i, (run, ckpt) in enumerate(runs):
    log: dict = {"loss": {}, "idx": {}, "scale": {}, "world_size": rt.world_size,
                 "async_save": rt.config.async_save,
                 "backend": rt.backend.name, "precision": rt.precision.name}
    start = 0
    if ckpt is not None:
        info = rt.load(ckpt, scheduler=scheduler)
        log["loaded_draws"], log["info"], log["loaded_masters"] = draws(), info, masters()
        log["lr"] = scheduler.get_last_lr()
        start = info["step"]
    train(start, log, save=i == 0)
    # full weights gathered by the backend (ZeRO-3 leaves empty placeholders in the module)
    log["params"] = [t.float().flatten().tolist()
                     for t in rt.backend.model_state_dict(model).values()]
    (out / f"{run}-rank{rt.rank}.json").write_text(json.dumps(log))
rt.close()
