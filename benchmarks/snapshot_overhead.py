"""What `--snapshot-every K` costs a training step of the digits and GPT examples.

    .venv/bin/python benchmarks/snapshot_overhead.py                  # both examples, 3 rounds
    .venv/bin/python benchmarks/snapshot_overhead.py --examples gpt --rounds 5
    .venv/bin/python benchmarks/snapshot_overhead.py --examples digits --every 10

Each example runs as a job of two one-process nodes on 127.0.0.1 (`mpt launch --nodes 2 --gpus 1
--nr 0|1`, gloo, one thread each, as if each had its own core), so that every snapshot is also
sent to the other node, as in a real job. A
round runs the example once with a snapshot every ``--every`` optimizer steps (default 1) and
once without, the side that goes first alternating. A run's step time is the median of its
``step_time_s`` records (``--run-dir``'s metrics.jsonl, one per 10 steps, or per snapshot
interval where that is longer, so that each record holds the same number of snapshots; the
first, warm-up record left out). The figure is the median over rounds of with/without, with
the rounds' spread: the goal is <= 1.05.

On a machine whose cores other work shares, step times wander more than a snapshot costs; the
CPU time the two nodes' processes used (user + system, every thread, from ``getrusage``) does
not, so each round also gives (CPU with - CPU without) / snapshots taken: what one snapshot
costs in CPU, on both nodes together, start-up and training being the same on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mpt.launchers.spec import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "digits": [str(ROOT / "examples" / "digits.py"), "--steps", "400"],
    "gpt": [str(ROOT / "examples" / "gpt.py"), "--steps", "60", "--eval-every", "1000",
            "--sample", "0"],
}


def step_time(example: str, every: int, log_every: int) -> tuple[float, float]:
    """Median seconds per step of one two-node run of ``example``, and the CPU seconds its
    processes used."""
    before = _children_cpu()
    with tempfile.TemporaryDirectory(prefix="mpt-snapshot-bench-") as tmp:
        port = str(free_port())
        flags = ["--snapshot-every", str(every)] if every else []
        nodes = [subprocess.Popen(
            [sys.executable, "-m", "mpt", "launch", "--nodes", "2", "--gpus", "1", "--nr",
             str(nr), "--master-port", port, "--quiet", "--log-every", str(log_every),
             *flags, *(["--run-dir", tmp] if nr == 0 else []), *EXAMPLES[example]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"}) for nr in (0, 1)]
        for node in nodes:
            output, _ = node.communicate(timeout=900)
            if node.returncode:
                raise SystemExit(f"{example} failed:\n{output[-3000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text()
                   .splitlines()]
        times = [r["step_time_s"] for r in records if r.get("step_time_s")][1:]
        return statistics.median(times), _children_cpu() - before


def _children_cpu() -> float:
    """CPU seconds of every ended child process (and theirs) so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", choices=sorted(EXAMPLES),
                        default=sorted(EXAMPLES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=1, help="--snapshot-every of the runs "
                        "with snapshots")
    args = parser.parse_args()
    log_every = args.every * max(1, 10 // args.every)  # each record's window: whole snapshots
    for example in args.examples:
        ratios, on_ms, off_ms, cpu_ms = [], [], [], []
        snapshots = int(EXAMPLES[example][EXAMPLES[example].index("--steps") + 1]) // args.every
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {side: step_time(example, args.every if side else 0, log_every)
                   for side in order}
            on_ms.append(got[True][0] * 1e3)
            off_ms.append(got[False][0] * 1e3)
            ratios.append(got[True][0] / got[False][0])
            cpu_ms.append((got[True][1] - got[False][1]) / snapshots * 1e3)
        print(f"{example}: step {statistics.median(on_ms):.2f} ms with a snapshot every "
              f"{args.every} step(s), "
              f"{statistics.median(off_ms):.2f} ms without: ratio {statistics.median(ratios):.3f}"
              f" (rounds {min(ratios):.3f}-{max(ratios):.3f}, {args.rounds} rounds); CPU per "
              f"snapshot {statistics.median(cpu_ms):.2f} ms (rounds {min(cpu_ms):.2f}-"
              f"{max(cpu_ms):.2f})", flush=True)


if __name__ == "__main__":
    main()
