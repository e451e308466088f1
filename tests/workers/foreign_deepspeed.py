"""A plain DeepSpeed training script (no mpt.Runtime): AdamW, a warm-up LR schedule, ZeRO.

usage: foreign_deepspeed.py OUT STAGE SAVE_AT STEPS [bf16] [ds-adamw]
``ds-adamw``: DeepSpeed's own AdamW from the config (DeepSpeedCPUAdam here) instead of torch's.
Trains STEPS steps of the shared model on ``foreign_common.batches`` (each rank its slice of
every global batch; gradients clipped to norm 1, DeepSpeed's default), saves
``engine.save_checkpoint(OUT/ds, client_state={step, epoch})`` after step SAVE_AT as a
DeepSpeed user's script would, and goes on: the losses after SAVE_AT
are DeepSpeed continuing itself, the curve an imported run must follow. Rank 0 writes
OUT/deepspeed.json (every step's loss over the global batch) and, under ZeRO, OUT/expected.pt:
every parameter's fp32 master and Adam moments at the save, as DeepSpeed's ``safe_get_full_*``
functions gather them.
"""

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks its accelerator

import deepspeed
import torch
import torch.distributed as dist
from common import make_model
from foreign_common import CLIP, GLOBAL_BATCH, batches, make_adamw, make_warmup, rank_slice
from torch import nn


def full_state(engine: deepspeed.DeepSpeedEngine) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's fp32 master and Adam moments, gathered by DeepSpeed's own functions
    (collectives: every rank calls)."""
    utils = deepspeed.utils
    params = dict(engine.module.named_parameters())
    state = {"fp32": {n: utils.safe_get_full_fp32_param(p).clone() for n, p in params.items()}}
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = {n: utils.safe_get_full_optimizer_state(p, key).clone()
                      for n, p in params.items()}
    return state


out, stage, save_at, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4])
bf16, ds_adamw = "bf16" in sys.argv[5:], "ds-adamw" in sys.argv[5:]
world = int(os.environ["WORLD_SIZE"])
dtype = torch.bfloat16 if bf16 else torch.float32  # DeepSpeed casts the model, not the data
model = make_model()
optimizer = make_adamw(model)
if ds_adamw:  # the same hyper-parameters, DeepSpeed's optimizer built from the config
    group = optimizer.param_groups[0]
    config_optimizer = {"optimizer": {"type": "AdamW", "params": {
        "lr": group["lr"], "weight_decay": group["weight_decay"]}}}
    optimizer = None
config = {**(config_optimizer if ds_adamw else {}), "train_batch_size": GLOBAL_BATCH,
          "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
          "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
          "gradient_clipping": CLIP,  # DeepSpeed's default, said out loud
          "steps_per_print": 10**6, "bf16": {"enabled": bf16}}
engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=optimizer,
                                  lr_scheduler=make_warmup)  # DeepSpeed hands it its optimizer
losses = []
for step, (x, y) in enumerate(batches(steps), start=1):
    part = rank_slice(engine.global_rank, world)
    loss = nn.functional.mse_loss(engine(x[part].to(dtype)).float(), y[part])
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    losses.append(total.item() / world)
    if step == save_at:
        engine.save_checkpoint(str(out / "ds"), client_state={"step": step, "epoch": 0})
        if stage > 0:  # what the conversion must reproduce, bit for bit, in DeepSpeed's words
            expected = full_state(engine)
if engine.global_rank == 0:
    (out / "deepspeed.json").write_text(json.dumps({"loss": losses}))
    if stage > 0:
        torch.save(expected, out / "expected.pt")
# As any raw gloo job must: leave the group and free gloo's work objects while Python is whole;
# left to interpreter teardown they abort the process now and then (see mpt/backends/ddp.py).
dist.destroy_process_group()
gc.collect()
