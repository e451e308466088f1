"""A plain DeepSpeed training script (no mpt.Runtime) that goes on with a run mpt started.

usage: ds_from_mpt.py CKPT OUT STAGE STEPS
CKPT is what `mpt checkpoint convert ckpt CKPT --to deepspeed` wrote. The script builds the
shared model, torch's AdamW and the warm-up schedule (``foreign_common``) as a DeepSpeed user
does, at ZeRO stage STAGE (with ``"checkpoint": {"load_universal": true}`` under ZeRO; an
ordinary load without it), resumes with ``engine.load_checkpoint(CKPT)`` (the tag ``latest`` or
``latest_universal`` names), takes its step from the ``client_state`` and trains on to step
STEPS on the shared global batches, each rank its slice. Rank 0 writes
OUT/ds-<STAGE>-<world size>.json: the client state, the learning rate after the load, and the
loss of every later step over the global batch.
"""

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks its accelerator

import deepspeed
import torch.distributed as dist
from common import make_model
from foreign_common import CLIP, GLOBAL_BATCH, batches, make_adamw, make_warmup, rank_slice
from torch import nn

source, out, stage, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4])
world = int(os.environ["WORLD_SIZE"])
model = make_model()
config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
          "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
          "gradient_clipping": CLIP, "steps_per_print": 10**6,
          "checkpoint": {"load_universal": stage > 0}}
engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=make_adamw(model),
                                  lr_scheduler=make_warmup)
path, client = engine.load_checkpoint(str(source))
assert path is not None, f"DeepSpeed loaded nothing from {source}"
lr = engine.optimizer.param_groups[0]["lr"]
losses = {}
for step, (x, y) in enumerate(batches(steps), start=1):
    if step <= client["step"]:
        continue
    part = rank_slice(engine.global_rank, world)
    loss = nn.functional.mse_loss(engine(x[part]), y[part])
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    losses[step] = total.item() / world
if engine.global_rank == 0:
    (out / f"ds-{stage}-{world}.json").write_text(json.dumps({
        "client_state": {k: v for k, v in client.items() if isinstance(v, int | float | str)},
        "lr": lr, "global_steps": engine.global_steps, "loss": losses}))
# As any raw gloo job must: leave the group and free gloo's work objects while Python is whole.
dist.destroy_process_group()
gc.collect()
