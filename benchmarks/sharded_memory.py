"""Resident memory of a sharded job and of its saves and loads, per rank, in one run.

    .venv/bin/mpt launch --gpus 2 --backend fsdp benchmarks/sharded_memory.py
    .venv/bin/mpt launch --gpus 2 --backend fsdp benchmarks/sharded_memory.py --layers 16 \
        --width 4096                               # 268 M parameters: 4 GiB of fp32 Adam state
    .venv/bin/mpt launch --gpus 2 --backend fsdp benchmarks/sharded_memory.py --layers 16 \
        --width 4096 --meta                        # built on the meta device
    .venv/bin/mpt launch --gpus 2 --backend deepspeed --zero-stage 3 \
        benchmarks/sharded_memory.py
    .venv/bin/mpt launch --gpus 4 --backend fsdp --fsdp-replicate 2 \
        benchmarks/sharded_memory.py               # HSDP: 2 replicas of 2 shards
    .venv/bin/mpt launch --gpus 2 --backend deepspeed --deepspeed-config \
        benchmarks/zero3_low_memory.json benchmarks/sharded_memory.py   # ZeRO-3, small buckets

A stack of ``--layers`` Linear(width, width) layers (each its own FSDP unit under fsdp) trains
with fp32 Adam for ``--steps`` steps, saves with ``rt.save`` (sharded: each rank writes its own
pieces where the backend shards), spoils the weights, loads, and trains one step more. A thread
samples this process's resident set size (RSS, from /proc) every 5 ms; each phase reports the
peak RSS above the RSS it started from. Figures per rank, against

- the full state: parameters, gradients and Adam's two moments of the whole model, 16 bytes per
  parameter (the goal for the peak RSS over the whole run: <= 0.65 x this on 2 ranks);
- the rank's share: the same divided by the ranks that split it (``dp_shard``: the world under
  fsdp, world/R under ``--fsdp-replicate R``) (the goal for what a save or a load adds:
  <= 0.25 x this).

A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

import mpt

GiB = 2**30


class RssSampler:
    """Peak resident set size of this process since the last ``reset``, sampled in a thread."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = self.highest = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = self.now()
            self.peak, self.highest = max(self.peak, rss), max(self.highest, rss)

    def reset(self) -> int:
        """Start a phase: its peak starts at the RSS of now, which is returned."""
        self.peak = self.now()
        return self.peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    parser.add_argument("--meta", action="store_true", help="build the model on the meta "
                        "device (fsdp initialises it one unit at a time)")
    args = parser.parse_args()

    sampler = RssSampler()
    start = sampler.now()
    rt = mpt.Runtime(quiet=True)
    torch.manual_seed(0)
    with torch.device("meta" if args.meta else "cpu"):
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    full_state = 16 * params  # weights, gradients, two Adam moments, fp32
    shards = rt.topology.plan.dp_shard  # the ranks that split it (HSDP: within a replica)
    share = full_state / shards
    model, _optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=1e-4))

    def train(steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(args.batch_size, args.width, device=rt.device)
            rt.backward(model(x).square().mean())
            rt.step()

    phases: dict[str, tuple[float, float]] = {}

    def phase(name: str, work) -> None:
        rt.barrier()
        before = sampler.reset()
        began = time.perf_counter()
        work()
        rt.barrier()
        phases[name] = (sampler.peak - before, time.perf_counter() - began)

    made = tempfile.mkdtemp(prefix="mpt-shard-mem-", dir=args.dir) if rt.rank == 0 else None
    root = Path(rt.backend.broadcast_object(made))
    phase("train", lambda: train(args.steps))
    trained_rss = sampler.now()
    phase("save", lambda: rt.save(root, step=args.steps))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    phase("load", lambda: rt.load(root))
    phase("train on", lambda: train(1))
    sampler.close()
    peak_run = sampler.highest

    rows = [f"rank {rt.rank}: {rt.backend.name}, {rt.world_size} ranks "
            f"({rt.topology.plan.describe()}), {params / 1e6:.0f} M "
            f"parameters; full fp32 Adam state {full_state / GiB:.2f} GiB, share "
            f"{share / GiB:.2f} GiB; RSS at start {start / GiB:.2f} GiB, after training "
            f"{trained_rss / GiB:.2f} GiB"]
    for name, (added, seconds) in phases.items():
        rows.append(f"  {name:9s} +{added / GiB:5.2f} GiB peak ({added / share:5.2f} x share) "
                    f"in {seconds:6.2f} s")
    rows.append(f"  peak RSS over the run {peak_run / GiB:.2f} GiB = {peak_run / full_state:.2f} "
                f"x the full state (goal <= 0.65 on 2 ranks); save/load goal <= 0.25 x share")
    for rank in range(rt.world_size):
        rt.barrier()
        if rank == rt.rank:
            print("\n".join(rows), flush=True)
    rt.close()


if __name__ == "__main__":
    main()
