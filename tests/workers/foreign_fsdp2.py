"""A plain FSDP2 training script (no mpt.Runtime) checkpointing with torch.distributed.checkpoint.

usage: foreign_fsdp2.py OUT SAVE_AT STEPS [LOAD]
``fully_shard`` on gloo, AdamW, gradient clipping and the warm-up schedule of
``foreign_common``; after step SAVE_AT it saves ``get_state_dict``'s model and optimizer, the
scheduler and a ``train_state`` with ``dcp.save`` into OUT/dcp, as a plain FSDP2 (or
torchtitan-style) script does, and goes on: the losses after SAVE_AT are the curve an imported
run must follow. Rank 0 writes OUT/fsdp2.json. With LOAD (a DCP directory) it resumes from that
instead (``dcp.load`` + ``set_state_dict``), saves nothing and writes OUT/fsdp2-resumed.json.
"""

import gc
import json
import sys
from pathlib import Path

import torch.distributed as dist
from common import make_model
from foreign_common import load_dcp, plain_run, save_dcp
from torch.distributed.fsdp import fully_shard

out, save_at, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resume_from = Path(sys.argv[4]) if len(sys.argv) > 4 else None
dist.init_process_group("gloo")
model = make_model()
fully_shard(model)
if resume_from is None:
    losses = plain_run(model, steps, save_at, save_dcp(out / "dcp"))
    record = {"loss": list(losses.values())}
else:
    record = {"loss": plain_run(model, steps, load=load_dcp(resume_from))}
if dist.get_rank() == 0:
    name = "fsdp2.json" if resume_from is None else "fsdp2-resumed.json"
    (out / name).write_text(json.dumps(record))
dist.destroy_process_group()
gc.collect()  # free gloo's work objects while Python is whole (see mpt/backends/ddp.py)
