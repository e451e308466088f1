"""An mpt script that goes on with a run another framework started (``--resume`` an imported one).

usage: mpt launch --resume CKPT ... foreign_resume.py OUT STEPS
The model, AdamW, gradient clipping and warm-up schedule of the plain scripts
(``foreign_common``), set up through mpt under whichever backend `mpt launch` picks;
``rt.resume`` restores the checkpoint that `mpt checkpoint convert` made, and the run trains on
to step STEPS on the same global batches.
Rank 0 writes OUT/mpt-<backend>-<world size>.json: the step it resumed at, the learning rate
then, and the loss of every later step.
"""

import json
import sys
from pathlib import Path

from foreign_common import continue_in_mpt, make_adamw, make_split_model, make_warmup

import mpt

out, steps = Path(sys.argv[1]), int(sys.argv[2])
rt = mpt.Runtime()
model = make_split_model()
model, optimizer = rt.setup(model, make_adamw(model))
scheduler = make_warmup(optimizer)
info = rt.resume(scheduler=scheduler)
log = {"step": info["step"], "epoch": info.get("epoch"), "lr": scheduler.get_last_lr(),
       "loss": continue_in_mpt(rt, scheduler, info["step"], steps)}
if rt.rank == 0:
    (out / f"mpt-{rt.backend.name}-{rt.world_size}.json").write_text(json.dumps(log))
rt.close()
