"""fp16-mixed on 2 ranks: rank 1 feeds an inf at step 3 only; record what every rank did.

usage: fp16_overflow.py OUT_DIR
Then save, spoil the scaler, load, and record the restored precision state.
"""

import sys
from pathlib import Path

import torch
from common import global_batches, make_model, make_optimizer
from torch import nn

import mpt
from mpt.precision import LossScaleConfig

out = Path(sys.argv[1])
rt = mpt.Runtime(precision="fp16-mixed", loss_scale=LossScaleConfig(init_scale=1024.0))
model = make_model()
model, optimizer = rt.setup(model, make_optimizer(model))
log = []
for step, (x, y) in enumerate(global_batches(6, 8)):
    x, y = x[rt.rank * 4:(rt.rank + 1) * 4].clone(), y[rt.rank * 4:(rt.rank + 1) * 4]
    if step == 3 and rt.rank == 1:
        x[0, 0] = float("inf")  # only one rank overflows; the allreduce spreads it
    with rt.autocast():
        loss = nn.functional.mse_loss(model(x.to(rt.device)), y.to(rt.device))
    rt.backward(loss)
    stepped = rt.step()
    log.append({"stepped": stepped, "scale": rt.precision.loss_scale})

saved = rt.precision.state_dict()
rt.save(out / "ckpt.pt", step=6)
rt.precision.scaler.update(new_scale=1.0)  # spoil the state, then restore it from the file
rt.precision.skipped_steps = 0
extra = rt.load(out / "ckpt.pt")
torch.save({"log": log, "saved": saved, "restored": rt.precision.state_dict(), "extra": extra,
            "params": [p.detach().cpu() for p in rt.backend.unwrap(model).parameters()]},
           out / f"rank{rt.rank}.pt")
rt.close()
