"""PowerSGD's error feedback across a checkpoint: run once, save midway, resume, compare.

usage: mpt launch --gpus 2 --grad-compression powersgd --checkpoint-dir DIR ... \
           powersgd_resume.py OUT_DIR STEPS SAVE_AT
Trains ``common.make_model`` on fixed per-rank batches from the step ``rt.resume()`` returns to
STEPS, saving after step SAVE_AT. Rank 0 writes OUT_DIR/from<start>.pt: the final parameters,
and (when it saved) the norm of each rank's error feedback in the checkpoint's state.
"""

import sys
from pathlib import Path

import torch
from common import global_batches, make_model, make_optimizer
from torch import nn

import mpt

MICRO = 4

out, steps, save_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rt = mpt.Runtime(quiet=True)
model = make_model()
model, optimizer = rt.setup(model, make_optimizer(model))
start = rt.resume()["step"]
errors = None
for step, (x, y) in enumerate(global_batches(steps, rt.world_size * MICRO)):
    if step < start:
        continue
    xs, ys = x[rt.rank * MICRO:(rt.rank + 1) * MICRO], y[rt.rank * MICRO:(rt.rank + 1) * MICRO]
    rt.backward(nn.functional.mse_loss(model(xs), ys))
    rt.step()
    if step + 1 == save_at:
        rt.save(step=save_at)
        errors = [[float(b["error"].norm()) for b in state["buckets"] if "error" in b]
                  for state in rt.backend.comm_state_dict(model)]
if rt.rank == 0:
    torch.save({"params": [p.detach().clone() for p in rt.backend.unwrap(model).parameters()],
                "errors": errors}, out / f"from{start}.pt")
rt.close()
