"""A 2-process ddp step of a small MLP, measured beside this machine's calibration.

Both run in the same two real gloo processes, one after the other, so that the figures the
cost model is given and the step it predicts see the same machine (other jobs share its cores).
The step is raw torch DDP (what mpt's ddp backend wraps: mpt/raw is 1.006 in
docs/benchmarks.md), one intra-op thread per process as `mpt launch` starts ranks, SGD with
momentum, fp32, the median of the slowest rank's steps after 3 warm-up steps.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

WIDTH = 2048
FEATURES = 512
BATCH = 16
"""Samples per rank per step."""


def build() -> nn.Module:
    """The measured model: 6.3 M parameters, 25.2 MB of fp32 gradients."""
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                         nn.ReLU(), nn.Linear(WIDTH, FEATURES))


def _steps(count: int) -> list[float]:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(build())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(BATCH, FEATURES), torch.randn(BATCH, FEATURES)
    times = []
    for step in range(count + 3):
        dist.barrier()
        start = time.perf_counter()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        took = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's step
        if step >= 3:
            times.append(took.item())
    return times


def _worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    from mpt.plan import calibrate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        collectives = calibrate.sweep(world, torch.device("cpu"), lambda: None)
        figures = calibrate.device_figures(torch.device("cpu"), lambda: None)
        times = _steps(steps)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"collectives": collectives, "figures": figures,
                                         "steps": times}))


def measure(port: int, steps: int = 8) -> tuple[Any, float]:
    """This machine's ``Calibration`` and the median measured step, from one 2-process job."""
    import torch.multiprocessing as mp

    from mpt.plan import calibrate

    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "step.json")
        mp.spawn(_worker, args=(2, port, steps, out), nprocs=2, join=True)
        found = json.loads(Path(out).read_text())
    calibration = calibrate.Calibration(identity=calibrate.identity(), ranks=2, backend="gloo",
                                        memory=2.0**34, collectives=found["collectives"],
                                        **found["figures"])
    return calibration, statistics.median(found["steps"])
