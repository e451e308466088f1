"""ZeRO-3 with one fp32 copy of each partition: mpt's engine against a raw DeepSpeed engine of
the same config, side by side in the same processes, on the same batches.

usage: zero3_masters.py OUT   (under `mpt launch --backend deepspeed --zero-stage 3`)
Rank 0 writes OUT (JSON): whether mpt's masters share the partitions' storage, whether the raw
engine's do (DeepSpeed's own alias branch), each side's losses and final full weights.
"""

import gc
import json
import sys

import deepspeed
import torch
from common import FEATURES, make_model
from torch import nn

import mpt

rt = mpt.Runtime()
model = make_model()
model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
twin = make_model()
raw, *_ = deepspeed.initialize(model=twin, config=rt.backend.config,
                               optimizer=torch.optim.Adam(twin.parameters(), lr=0.01),
                               dist_init_required=False)


def shared(engine: deepspeed.DeepSpeedEngine) -> list[bool]:
    zero = engine.optimizer
    return [m.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
            for w, m in zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat,
                            strict=True)]


report = {"mpt_shared": shared(model), "raw_shared": shared(raw), "mpt": [], "raw": []}
g = torch.Generator().manual_seed(5)
for _ in range(4):
    x, y = torch.randn(8, FEATURES, generator=g), torch.randn(8, 1, generator=g)
    part = slice(rt.rank * (8 // rt.world_size), (rt.rank + 1) * (8 // rt.world_size))
    loss = nn.functional.mse_loss(model(x[part]), y[part])
    rt.backward(loss)
    rt.step()
    report["mpt"].append(rt.all_reduce(loss.detach()).item())
    raw_loss = nn.functional.mse_loss(raw(x[part]), y[part])
    raw.backward(raw_loss)
    raw.step()
    report["raw"].append(rt.all_reduce(raw_loss.detach()).item())
weights = {"mpt": rt.backend.model_state_dict(model),
           "raw": {n: deepspeed.utils.safe_get_full_fp32_param(p).clone()
                   for n, p in raw.module.named_parameters()}}
report["same_weights"] = all(torch.equal(weights["mpt"][n], weights["raw"][n])
                             for n in weights["raw"])
if rt.rank == 0:
    with open(sys.argv[1], "w") as out:
        json.dump(report, out)
del raw
gc.collect()
rt.close()
