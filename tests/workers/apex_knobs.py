"""Backend ``apex`` on 2 ranks: Apex DDP's knobs against plain torch DDP, and a short training.

usage: apex_knobs.py OUT_DIR STEPS MICRO
Writes rank<r>.pt with the gradients each knob setting left (the second backward, after DDP
rebuilt its buckets), the allreduces it sent, and the parameters the runtime trained to.
"""

import sys
from pathlib import Path

import torch
from common import global_batches, make_model, make_optimizer
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import mpt
from mpt.backends.apex import ApexDistributedDataParallel

out, steps, micro = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rt = mpt.Runtime()  # backend apex and its knobs come from `mpt launch`'s flags
model = make_model()
model, optimizer = rt.setup(model, make_optimizer(model))
for x, y in global_batches(steps, rt.world_size * micro):
    xs, ys = x[rt.rank * micro:(rt.rank + 1) * micro], y[rt.rank * micro:(rt.rank + 1) * micro]
    with rt.autocast():
        loss = nn.functional.mse_loss(model(xs), ys)
    rt.backward(loss)
    rt.step()
trained = [p.detach().clone() for p in rt.backend.unwrap(model).parameters()]
settings = model.reduce_settings
launched_knobs = {"options": rt.backend.option_values, "predivide":
                  settings.gradient_predivide_factor, "fp32": settings.allreduce_always_fp32,
                  "bucket_mb": rt.backend.comm.bucket_mb}

KNOBS = {
    "apex defaults": {},
    "delay_allreduce": {"delay_allreduce": True, "message_size": 40},
    "message_size 40": {"message_size": 40},
    "predivide 2": {"gradient_predivide_factor": 2.0},
    "predivide 8, fp32": {"gradient_predivide_factor": 8.0, "allreduce_always_fp32": True},
    "sum": {"gradient_average": False},
}
(x, y), = global_batches(1, rt.world_size * micro)
xs, ys = x[rt.rank * micro:(rt.rank + 1) * micro], y[rt.rank * micro:(rt.rank + 1) * micro]
results = {}
for name, knobs in {"plain ddp": None, **KNOBS}.items():
    ddp = TorchDDP(make_model()) if knobs is None else ApexDistributedDataParallel(
        make_model(), **knobs)
    for _ in range(2):  # DDP rebuilds its buckets after the first backward: measure the second
        ddp.zero_grad(set_to_none=True)
        before = ddp.reduce_settings.buckets_reduced if knobs is not None else 0
        nn.functional.mse_loss(ddp(xs), ys).backward()
    results[name] = {
        "grads": [p.grad.detach().clone() for p in ddp.module.parameters()],
        "allreduces": ddp.reduce_settings.buckets_reduced - before if knobs is not None else None,
    }
# Bucketing on a deeper stack: 6 layers of 72 elements each, message_size 40 -> one per layer.
buckets = {}
for name, knobs in {"message_size 40": {"message_size": 40},
                    "delay_allreduce": {"message_size": 40, "delay_allreduce": True}}.items():
    torch.manual_seed(0)
    ddp = ApexDistributedDataParallel(nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]),
                                      **knobs)
    for _ in range(3):
        before = ddp.reduce_settings.buckets_reduced
        ddp(xs).sum().backward()
    buckets[name] = ddp.reduce_settings.buckets_reduced - before
# Four layers of 0.61 MiB, message_size 2 MiB: the first bucket (the last layers' gradients)
# closes at torch's 1 MiB, the rest at 2 MiB: two buckets, not one.
torch.manual_seed(0)
ddp = ApexDistributedDataParallel(nn.Sequential(*[nn.Linear(400, 400) for _ in range(4)]),
                                  message_size=2 * 2**20 // 4)
for _ in range(3):
    before = ddp.reduce_settings.buckets_reduced
    ddp(torch.ones(2, 400)).sum().backward()
buckets["message_size 2 MiB"] = ddp.reduce_settings.buckets_reduced - before
torch.save({"results": results, "buckets": buckets, "launched": launched_knobs,
            "trained": trained, "wrapper": type(model).__name__, "backend": rt.backend.name},
           out / f"rank{rt.rank}.pt")
rt.close()
