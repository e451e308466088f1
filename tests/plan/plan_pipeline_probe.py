"""Two real gloo processes run the calibration's pipeline probe (``pipeline_overheads``)."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path

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


def measure(port: int) -> dict[str, float]:
    """Seconds per action of each schedule, as rank 0 of the probe found them."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "probe.json")
        mp.spawn(_worker, args=(port, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())
