"""Two real gloo processes run the calibration's pipeline probe (``pipeline_overheads``)."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from mpt.plan.calibrate import pipeline_overheads

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    found = pipeline_overheads(dist.new_group([0, 1]), rank, torch.device("cpu"), lambda: None)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    os._exit(0)  # as plan_ddp_step's ranks: no interpreter teardown under gloo's threads


def on_two_ranks(worker: Callable[[int, int, str], None], port: int) -> Any:
    """What rank 0 of two processes running ``worker(rank, port, out)`` wrote into ``out``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "found.json")
        mp.spawn(worker, args=(port, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def measure(port: int) -> dict[str, float]:
    """Seconds per action of each schedule, as rank 0 of the probe found them."""
    return on_two_ranks(_worker, port)
