"""A 2-process ddp step of a small MLP, measured beside this machine's calibration.

Both run in the same two real gloo processes, one after the other and in alternating rounds
(calibration, steps, calibration, steps, ...), so that the figures the cost model is given and
the steps it predicts see the same machine (other jobs share its cores) over the same minutes.
The step is raw torch DDP (what mpt's ddp backend wraps: mpt/raw is 1.006 in
docs/benchmarks.md), one intra-op thread per process as `mpt launch` starts ranks, SGD with
momentum, fp32, the median of the slowest rank's steps after 3 warm-up steps.
"""

from __future__ import annotations

import json
import os
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


def join(rank: int, world: int, port: int) -> None:
    """This process as a gloo rank, one intra-op thread, as `mpt launch` starts one."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def calibration_round(world: int) -> dict[str, Any]:
    """What `mpt plan --calibrate` measures, from this rank (every rank calls it)."""
    import torch.distributed as dist

    from mpt.plan import calibrate

    collectives = calibrate.sweep(world, torch.device("cpu"), lambda: None)
    dist.barrier()
    return {"collectives": collectives,
            "figures": calibrate.device_figures(torch.device("cpu"), lambda: None)}


def _worker(rank: int, world: int, port: int, steps: int, rounds: int, out: str) -> None:
    import torch.distributed as dist

    join(rank, world, port)
    try:
        found = [{**calibration_round(world), "steps": _steps(steps)} for _ in range(rounds)]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    # Leave without the interpreter's teardown: in it a gloo thread still joinable aborted
    # the process ("terminate called without an active exception", no Python frame) in 2 of
    # 10 jobs, after everything here had finished.
    os._exit(0)


def measure(port: int, steps: int = 8, rounds: int = 2) -> list[tuple[Any, float]]:
    """Each round's ``Calibration`` of this machine and its median measured step, from one
    2-process job."""
    import torch.multiprocessing as mp

    from mpt.plan import calibrate

    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "step.json")
        mp.spawn(_worker, args=(2, port, steps, rounds, out), nprocs=2, join=True)
        found = json.loads(Path(out).read_text())
    return [(calibrate.Calibration(identity=calibrate.identity(), ranks=2, backend="gloo",
                                   memory=2.0**34, collectives=one["collectives"],
                                   **one["figures"]), statistics.median(one["steps"]))
            for one in found]
