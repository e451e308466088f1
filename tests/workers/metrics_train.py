"""Train a tiny regression through mpt with its metrics on; the launch flags choose the rest.

usage: metrics_train.py STEPS [SLEEP_S]
A LambdaLR halves the learning rate every 10 steps, so the recorded lr must fall; each "epoch"
of 10 steps ends with rt.log(epoch=..., val_loss=...). SLEEP_S (per step) slows it down for the
progress-bar test.
"""

import sys
import time

import torch
from common import FEATURES, make_model, make_optimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt

steps = int(sys.argv[1])
sleep = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
rt = mpt.Runtime()
g = torch.Generator().manual_seed(0)
x = torch.randn(16 * 10 * rt.world_size, FEATURES, generator=g)
data = TensorDataset(x, x.sum(dim=1, keepdim=True))
model = make_model()
model, optimizer = rt.setup(model, make_optimizer(model))
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** (step // 10))
loader = rt.setup_dataloader(DataLoader(data, batch_size=16, shuffle=True))
rt.progress(total=steps)
rt.print(f"training {steps} steps of {len(loader)} per epoch")
done = 0
while done < steps:
    for xb, yb in loader:
        with rt.autocast():
            loss = nn.functional.mse_loss(model(xb), yb)
        rt.backward(loss)
        rt.clip_grad_norm_(100.0)
        rt.step()
        schedule.step()
        done += 1
        if sleep:
            time.sleep(sleep)
        if done == steps:
            break
    rt.log(epoch=done // len(loader), val_loss=loss.detach())
rt.print("finished")
rt.close()
