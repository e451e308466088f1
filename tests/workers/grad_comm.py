"""``--grad-compression`` and ``--bucket-mb`` on 2 ranks, against the same loop in plain torch.

usage: mpt launch --gpus 2 grad_comm.py OUT_DIR STEPS
For each backend built on torch's DDP or fully_shard (ddp, apex, fsdp) and each compression it
takes, trains a fresh ``common.make_model`` through the backend (built here, in the job's
process group) and through plain torch with the same comm hook or reduce dtype, on the same
per-rank batches. Writes rank<r>.pt: both runs' final parameters per case, and the buckets
PowerSGD laid out under ``--bucket-mb`` on a 6-layer stack.
"""

import sys
from pathlib import Path

import torch
from common import global_batches, make_model, make_optimizer
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import mpt
from mpt.backends import get_backend
from mpt.comm import GradComm

MICRO = 4
POWERSGD = {"powersgd_rank": 1, "powersgd_start_step": 2}
CASES = [("ddp", "none"), ("ddp", "fp16"), ("ddp", "bf16"), ("ddp", "powersgd"),
         ("apex", "fp16"), ("apex", "bf16"), ("apex", "powersgd"),
         ("fsdp", "fp16"), ("fsdp", "bf16")]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

out, steps = Path(sys.argv[1]), int(sys.argv[2])
rt = mpt.Runtime(quiet=True)  # joins the job's group; every backend below reduces over it
batches = [(x[rt.rank * MICRO:(rt.rank + 1) * MICRO], y[rt.rank * MICRO:(rt.rank + 1) * MICRO])
           for x, y in global_batches(steps, rt.world_size * MICRO)]


def make_backend(name: str, comm: GradComm, model_options: dict) -> object:
    return get_backend(name)(world=rt.world, device=rt.device, precision=rt.precision,
                             comm=comm, options=model_options)


def through_mpt(name: str, compression: str) -> list[torch.Tensor]:
    options = POWERSGD if compression == "powersgd" else {}
    backend = make_backend(name, GradComm(compression=compression), options)
    model = make_model()
    model, optimizer = backend.setup(model, make_optimizer(model))
    for x, y in batches:
        backend.backward(nn.functional.mse_loss(model(x), y))
        backend.optimizer_step(model, optimizer)
        backend.zero_grad(optimizer)
    return [t.detach().clone() for t in backend.model_state_dict(model).values()]


def through_torch(name: str, compression: str) -> list[torch.Tensor]:
    model = make_model()
    if name == "fsdp":
        fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=DTYPES[compression]))
        trained = model
    else:
        trained = DistributedDataParallel(model)
        if compression == "powersgd":
            state = PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                  start_powerSGD_iter=2)
            trained.register_comm_hook(state, powerSGD_hook)
        elif compression != "none":
            hook = {"fp16": default_hooks.fp16_compress_hook,
                    "bf16": default_hooks.bf16_compress_hook}[compression]
            trained.register_comm_hook(None, hook)
    optimizer = make_optimizer(model)
    for x, y in batches:
        nn.functional.mse_loss(trained(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if name == "fsdp":
        return [p.full_tensor().detach().clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()]


results = {f"{name} {compression}": {"mpt": through_mpt(name, compression),
                                     "torch": through_torch(name, compression)}
           for name, compression in CASES}

# --bucket-mb: 6 layers of 72 fp32 elements, buckets of 40 elements -> one bucket per layer,
# as PowerSGD (which keeps its state per bucket) lays them out.
backend = make_backend("ddp", GradComm(compression="powersgd", bucket_mb=40 * 4 / 2**20),
                       POWERSGD)
torch.manual_seed(0)
stack = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
stack, optimizer = backend.setup(stack, torch.optim.SGD(stack.parameters(), lr=0.01))
for x, _ in batches[:3]:
    backend.backward(stack(x).square().mean())
    backend.optimizer_step(stack, optimizer)
    backend.zero_grad(optimizer)
buckets = [b["params"] for b in backend.comm_state_dict(stack)[rt.rank]["buckets"]]

torch.save({"results": results, "buckets": buckets}, out / f"rank{rt.rank}.pt")
rt.close()
