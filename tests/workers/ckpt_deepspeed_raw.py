"""A raw DeepSpeed ZeRO-2 job (no mpt.Runtime) that writes a native DeepSpeed checkpoint.

usage: ckpt_deepspeed_raw.py OUT
Trains 3 steps of Adam on the shared model and calls ``engine.save_checkpoint(OUT/ds)``, as a
DeepSpeed user's script would; rank 0 also writes OUT/expected.pt (plain tensors): the full
fp32 weights gathered from the shards, which `mpt checkpoint convert` must reproduce.
"""

import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks its accelerator

import deepspeed
import torch
from common import FEATURES, make_model
from torch import nn

out = Path(sys.argv[1])
world = int(os.environ["WORLD_SIZE"])
model = make_model()
config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // world,
          "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
          "steps_per_print": 10**6}
engine, *_ = deepspeed.initialize(model=model, config=config,
                                  optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
g = torch.Generator().manual_seed(5)
for _ in range(3):
    x, y = torch.randn(8, FEATURES, generator=g), torch.randn(8, 1, generator=g)
    part = slice(engine.global_rank * (8 // world), (engine.global_rank + 1) * (8 // world))
    engine.backward(nn.functional.mse_loss(engine(x[part]), y[part]))
    engine.step()
engine.save_checkpoint(str(out / "ds"))
full = {name: deepspeed.utils.safe_get_full_fp32_param(p).clone()
        for name, p in engine.module.named_parameters()}  # collective: every rank calls
if engine.global_rank == 0:
    torch.save(full, out / "expected.pt")
# As any raw gloo job must: leave the group and free gloo's work objects while Python is whole;
# left to interpreter teardown they abort the process now and then (see mpt/backends/ddp.py).
torch.distributed.destroy_process_group()
gc.collect()
