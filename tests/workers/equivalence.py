"""Train through mpt on slices of the global batches; save this rank's final parameters.

usage: equivalence.py OUT_DIR STEPS MICRO_BATCH [ACCUMULATE [meta]]
Each rank runs ACCUMULATE micro-batches of MICRO_BATCH rows per step, so a step consumes
world_size * ACCUMULATE * MICRO_BATCH rows of the global batch. A DDP comm hook counts the
allreduces actually sent.
"""

import sys
from pathlib import Path

import torch
from common import global_batches, make_model, make_optimizer
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import mpt

out, steps, micro = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
accumulate = int(sys.argv[4]) if len(sys.argv) > 4 else 1
meta = sys.argv[5:] == ["meta"]  # build it on the meta device (fsdp materialises it)
rt = mpt.Runtime(accumulate=accumulate)
with torch.device("meta" if meta else "cpu"):
    model = make_model()
model, optimizer = rt.setup(model, make_optimizer(model))

allreduces = [0]


def counting_hook(state, bucket):
    allreduces[0] += 1
    return default_hooks.allreduce_hook(None, bucket)


if isinstance(model, nn.parallel.DistributedDataParallel):
    model.register_comm_hook(None, counting_hook)

per_step = rt.world_size * accumulate * micro
stepped = []
for x, y in global_batches(steps, per_step):
    for j in range(accumulate):
        start = (rt.rank * accumulate + j) * micro
        xs, ys = x[start:start + micro].to(rt.device), y[start:start + micro].to(rt.device)
        with rt.autocast():
            loss = nn.functional.mse_loss(model(xs), ys)
        rt.backward(loss)
        stepped.append(rt.step())

full = rt.backend.model_state_dict(model)  # sharding backends keep a piece in the module
params = [full[name].detach().cpu() for name, _ in rt.backend.unwrap(model).named_parameters()]
local_numel = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
torch.save({"params": params, "allreduces": allreduces[0], "stepped": stepped,
            "local_numel": local_numel,
            "rank": rt.rank, "world_size": rt.world_size}, out / f"rank{rt.rank}.pt")
rt.close()
