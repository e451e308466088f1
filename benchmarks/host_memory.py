"""`--host-memory`: each mode's CPU step and peak resident memory against glibc's defaults (fast).

    .venv/bin/python benchmarks/host_memory.py                       # 3 models x 5 backends
    .venv/bin/python benchmarks/host_memory.py --models resnet18 --backends ddp,fsdp --rounds 3

Every cell trains one of `scaling.py`'s models (the 25.2 M-parameter MLP, ResNet-18, the GPT)
at one rank of one thread, batch 8, SGD with momentum, as `scaling.py`'s one-node cells do,
under `mpt launch --gpus 1 --backend B --host-memory M`. The modes run one after another in
each of ``--rounds`` rounds (a fresh job each), so that a slow minute of a shared machine falls
on all of them alike. Each job times ``--steps`` steps after ``--warmup`` and reads its peak
resident set above the RSS before the model was built (``VmHWM``). Per cell it prints each
mode's median step and peak over the rounds, and their ratios to fast's.

A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpt.environments.host_memory import HOST_MEMORY

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def worker(args: argparse.Namespace) -> None:
    """One job: ``args.models`` (one) under the launch's backend and mode; its JSON to
    ``args.worker``."""
    import torch
    from plan_memory import peak_rss, reset_peak_rss
    from scaling import batches, build_model, loss_of, mpt_step

    import mpt

    rt = mpt.Runtime(quiet=True)
    before = reset_peak_rss()
    net = build_model(args.models)
    model, _ = rt.setup(net, torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9))
    loss_fn, data = loss_of(args.models), batches(args.models, rt.rank, 4)
    steps = []
    for i in range(args.warmup + args.steps):
        x, y = data[i % len(data)]
        start = time.perf_counter()
        mpt_step(rt, model, loss_fn, x, y)
        steps.append(time.perf_counter() - start)
    Path(args.worker).write_text(json.dumps({
        "step": statistics.median(steps[args.warmup:]), "peak": peak_rss() - before}))
    rt.close()


def run(model: str, backend: str, mode: str, args: argparse.Namespace) -> dict:
    """One job of ``model`` under ``backend`` and ``mode``: its step and peak (``worker``)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "cell.json"
        subprocess.run([str(Path(sys.executable).parent / "mpt"), "launch", "--gpus", "1",
                        "--backend", backend, "--host-memory", mode, __file__, "--worker",
                        str(out), "--models", model, "--steps", str(args.steps), "--warmup",
                        str(args.warmup)], check=True, cwd=ROOT, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set by the driver: one job
    parser.add_argument("--models", default="mlp,resnet18,gpt")
    parser.add_argument("--backends", default="ddp,apex,horovod,deepspeed,fsdp")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"| model | backend | {' | '.join(f'{m}: step s, peak MiB' for m in HOST_MEMORY)} | "
          f"{' | '.join(f'{m} / fast: step, peak' for m in HOST_MEMORY[1:])} |")
    print("| --- | --- |" + " --- |" * (2 * len(HOST_MEMORY) - 1))
    for model in args.models.split(","):
        for backend in args.backends.split(","):
            found: dict[str, list[dict]] = {mode: [] for mode in HOST_MEMORY}
            for _ in range(args.rounds):
                for mode in HOST_MEMORY:
                    found[mode].append(run(model, backend, mode, args))
            cell = {mode: (statistics.median(r["step"] for r in rows),
                           statistics.median(r["peak"] for r in rows) / MiB)
                    for mode, rows in found.items()}
            fast = cell["fast"]
            print(f"| {model} | {backend} | "
                  + " | ".join(f"{s:.3f}, {p:.0f}" for s, p in cell.values()) + " | "
                  + " | ".join(f"{cell[m][0] / fast[0]:.2f}, {cell[m][1] / fast[1]:.2f}"
                               for m in HOST_MEMORY[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
