"""Two real gloo processes time the same work through the calibration's ``_timed``, once with
``align`` a barrier of theirs (as ``device_figures`` and ``ModelStep`` run) and once alone:
rank 0's work takes 1 ms, rank 1's 40 ms."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
from plan_pipeline_probe import on_two_ranks

SHORT, LONG = 0.001, 0.04
"""Seconds of rank 0's work and of rank 1's."""


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from mpt.plan.calibrate import _timed, alone

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    found = {}
    for name, align in (("aligned", dist.barrier), ("alone", alone)):
        starts: list[float] = []

        def work(starts: list[float] = starts) -> None:
            starts.append(time.perf_counter())
            time.sleep(LONG if rank else SHORT)

        dist.barrier()
        median = _timed(work, 5, lambda: None, align)
        found[name] = {"median": median, "starts": starts}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    os._exit(0)  # as plan_ddp_step's ranks: no interpreter teardown under gloo's threads


def measure(port: int) -> dict[str, dict]:
    """Rank 0's median and the start of each of its runs (the warm-up's first), per way."""
    return on_two_ranks(_worker, port)
