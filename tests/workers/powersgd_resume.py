"""PowerSGD's error feedback across a checkpoint: train, save midway, resume in a fresh wrapper.

usage: mpt launch --gpus 2 --grad-compression powersgd --checkpoint-dir DIR ... \
           powersgd_resume.py OUT_DIR STEPS SAVE_AT [RESUME_BUCKET_MB]
Trains ``common.make_model`` on fixed per-rank batches for STEPS steps, saving after SAVE_AT
(``rt.save``). Then, as a resumed job would, builds a fresh model and DDP wrapper (its buckets as
DDP lays them out before its first step; with RESUME_BUCKET_MB, other buckets), loads the
checkpoint into it (``mpt.checkpoint.load_checkpoint``, what ``rt.load`` calls) and trains steps
SAVE_AT.. STEPS. Rank 0 writes OUT_DIR/result.pt: both runs' final parameters and the norm of
each rank's error feedback in the saved state.
"""

import sys
from pathlib import Path

import torch
from common import global_batches, make_model, make_optimizer
from torch import nn

import mpt
from mpt.checkpoint import TrainingState, load_checkpoint
from mpt.comm import GradComm
from mpt.pairs import Pair

MICRO = 4

out, steps, save_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rt = mpt.Runtime(quiet=True)
batches = [(x[rt.rank * MICRO:(rt.rank + 1) * MICRO], y[rt.rank * MICRO:(rt.rank + 1) * MICRO])
           for x, y in global_batches(steps, rt.world_size * MICRO)]
model = make_model()
model, optimizer = rt.setup(model, make_optimizer(model))
for step, (x, y) in enumerate(batches):
    rt.backward(nn.functional.mse_loss(model(x), y))
    rt.step()
    if step + 1 == save_at:
        saved = rt.save(step=save_at)
        errors = [[float(b["error"].norm()) for b in state["buckets"] if "error" in b]
                  for state in rt.backend.comm_state_dict(model)]

comm = rt.backend.comm if len(sys.argv) < 5 else GradComm(compression="powersgd",
                                                           bucket_mb=float(sys.argv[4]))
backend = type(rt.backend)(world=rt.world, device=rt.device, precision=rt.precision,
                           options=rt.config.backend_options, comm=comm)
again = make_model()
again, again_optimizer = backend.setup(again, make_optimizer(again))
load_checkpoint(saved, TrainingState(backend=backend, pairs=[
    Pair(name="model", model=again, optimizer=again_optimizer)]))
for x, y in batches[save_at:]:
    backend.backward(nn.functional.mse_loss(again(x), y))
    backend.optimizer_step(again, again_optimizer)
    backend.zero_grad(again_optimizer)
if rt.rank == 0:
    torch.save({"whole": [p.detach().clone() for p in rt.backend.unwrap(model).parameters()],
                "resumed": [p.detach().clone() for p in backend.unwrap(again).parameters()],
                "errors": errors}, out / "result.pt")
rt.close()
