"""What the per-step preemption agreement costs a training step, on every backend.

    .venv/bin/mpt launch --gpus 2 benchmarks/preemption_overhead.py
    .venv/bin/mpt launch --gpus 2 --backend deepspeed benchmarks/preemption_overhead.py
    .venv/bin/mpt launch --gpus 2 --backend horovod benchmarks/preemption_overhead.py

Every ``rt.step()`` waits for the previous step's one-integer sum over all ranks and starts the
next (``mpt.fault.Preemption``). Here each rank does that after a stand-in for a step's compute
(a busy loop of ``--step-ms``, or a sleep with ``--idle``), as in training, and the time spent
inside ``should_stop`` is measured with ``time.perf_counter`` on every rank: the mean per step
(the checks fall every few steps, see ``mpt.fault.preemption``), its share of the step, and the
slowest call. With a core to spare the sum is done long before it is collected; on a machine
with no core to spare (2 busy ranks on 2 cores) gloo's thread waits for one, and so does the
check that collects its sum.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mpt
from mpt.fault import Preemption


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--idle", action="store_true", help="sleep through the step (a GPU "
                        "computing) instead of keeping the core busy (a CPU computing)")
    args = parser.parse_args()
    rt = mpt.Runtime()
    preemption = Preemption()
    times = []
    for _ in range(args.steps):
        (time.sleep(args.step_ms / 1e3) if args.idle else busy(args.step_ms))
        start = time.perf_counter()
        preemption.should_stop(rt.backend.sum_async, rt.world_size)
        times.append(time.perf_counter() - start)
    preemption.close()
    times = times[100:]  # the first calls open the group and learn the step time
    mine = torch.tensor([statistics.fmean(times), max(times)], dtype=torch.float64)
    rt.all_reduce(mine, op="max")
    mean, worst = (float(v) * 1e6 for v in mine)
    rt.print(f"preemption agreement, {rt.backend.name} on {rt.world_size} process(es), a check "
             f"every {preemption.every} step(s) of {args.step_ms:g} ms: {mean:.1f} us per step "
             f"on average = {mean / (args.step_ms * 1e3):.3%} of the step; slowest call "
             f"{worst:.0f} us (max over ranks)")
    rt.close()


if __name__ == "__main__":
    main()
