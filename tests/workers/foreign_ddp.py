"""A plain torchrun-style DDP script (no mpt.Runtime) that checkpoints with torch.save.

usage: foreign_ddp.py OUT SAVE_AT STEPS
DDP on gloo, AdamW, gradient clipping and the warm-up schedule of ``foreign_common``; after
step SAVE_AT rank 0 saves ``{"model": ddp.state_dict() (keys "module.<name>"), "optimizer",
"scheduler", "step", "epoch"}`` with ``torch.save`` into OUT/ddp.pt, as such scripts do, and
the run goes on: the losses after SAVE_AT are the curve an imported run must follow. Rank 0
writes OUT/ddp.json.
"""

import gc
import json
import sys
from pathlib import Path

import torch.distributed as dist
from common import make_model
from foreign_common import plain_run, save_torch
from torch.nn.parallel import DistributedDataParallel

out, save_at, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
losses = plain_run(DistributedDataParallel(make_model()), steps, save_at,
                   save_torch(out / "ddp.pt"))
if dist.get_rank() == 0:
    (out / "ddp.json").write_text(json.dumps({"loss": list(losses.values())}))
dist.destroy_process_group()
gc.collect()  # free gloo's work objects while Python is whole (see mpt/backends/ddp.py)
