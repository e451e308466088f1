"""What each rank holds while ``rt.load`` imports another framework's checkpoint under fsdp.

Make the source with ``zero_conversion.py --make`` (DeepSpeed alone, ZeRO-3, ``--layers`` x
``nn.Linear(width, width)``, AdamW), then measure::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/tmp/ds-ext .venv/bin/python \\
        benchmarks/zero_conversion.py --make /tmp/fr/ds --layers 21 --nproc 2   # 352 M
    .venv/bin/python benchmarks/foreign_resume_memory.py /tmp/fr/ds --layers 21 [--gpus 2]

Each way runs in its own ``mpt launch --backend fsdp --gpus N`` (gloo, CPU), which builds the
same model, sets it up with AdamW and then, on every rank, resets the process's peak RSS
(``/proc/self/clear_refs``: 5) and loads the source:

- **copy**: what ``rt.load`` did before: every rank reads the source, writes it whole as an
  mpt checkpoint into a temporary directory of its own (``foreign.write``) and loads that
  (``rt.load`` of an mpt checkpoint);
- **direct**: ``rt.load(SRC)`` as it is now: each rank restores from the imported state,
  reading only its own pieces of the ZeRO files.

Every rank prints its peak RSS (``VmHWM``) over what it held just before the load, against its
share of the state (fp32 weights and AdamW's two moments: 12 bytes per parameter / N), and
the largest anonymous RSS (``RssAnon``, sampled every 5 ms: what the page cache cannot take
back), and the bytes it wrote to disk (``/proc/self/io``). The two ways alternate in order
each round. A benchmark: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

GIB = 1024 ** 3
WAYS = ("copy", "direct")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a DeepSpeed ZeRO checkpoint directory (--make's)")
    parser.add_argument("--layers", type=int, default=21)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--gpus", type=int, default=2, help="processes of the resuming run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    return parser.parse_args()


def _status(*keys: str) -> dict[str, int]:
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            found[key] = int(value.split()[0]) * 1024
    return found


def _written() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def worker(args: argparse.Namespace) -> None:
    """One rank: set up, then load the source the way ``--worker`` names; report."""
    import torch
    from torch import nn

    import mpt
    from mpt.checkpoint import foreign

    rt = mpt.Runtime()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    model, _ = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    rt.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS", "RssAnon")
    wrote = _written()
    peak_anon, done = [before["RssAnon"]], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak_anon[0] = max(peak_anon[0], _status("RssAnon")["RssAnon"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if args.worker == "copy":  # rt.load before: a whole mpt checkpoint per rank, then loaded
        imported = foreign.read(Path(args.source))
        with tempfile.TemporaryDirectory(prefix="mpt-import-") as folder:
            url = foreign.write(imported, folder, step=imported.step or 0,
                                source_path=args.source)
            del imported
            info = rt.load(url)
    else:
        info = rt.load(args.source)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    after = _status("VmHWM")
    report = {"rank": rt.rank, "params": params, "world": rt.world_size, "step": info["step"],
              "before": before["VmRSS"], "peak": after["VmHWM"],
              "anon_before": before["RssAnon"], "anon_peak": peak_anon[0],
              "wrote": _written() - wrote, "seconds": seconds}
    Path(f"{args.report}.{rt.rank}").write_text(json.dumps(report))
    rt.close()


def run_way(args: argparse.Namespace, way: str, report: str) -> list[dict[str, Any]]:
    mpt_cli = Path(sys.executable).with_name("mpt")
    cmd = [str(mpt_cli), "launch", "--gpus", str(args.gpus), "--backend", "fsdp", __file__,
           args.source, "--layers", str(args.layers), "--width", str(args.width),
           "--worker", way, "--report", report]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{way}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return [json.loads(Path(f"{report}.{r}").read_text()) for r in range(args.gpus)]


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    ways = args.ways.split(",")
    over: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for way in ways if rnd % 2 == 0 else ways[::-1]:
                reports = run_way(args, way, f"{tmp}/{way}-{rnd}")
                for r in reports:
                    share = 12 * r["params"] / r["world"]
                    grew = r["peak"] - r["before"]
                    over[way].append(grew / share)
                    print(f"round {rnd + 1} {way:6s} rank {r['rank']}: peak RSS "
                          f"{r['peak'] / GIB:.3f} GiB, {grew / GIB:+.3f} GiB over the "
                          f"{r['before'] / GIB:.3f} before = {grew / share:.2f} x its share "
                          f"({share / GIB:.3f} GiB); anonymous {r['anon_peak'] / GIB:.3f} GiB "
                          f"({(r['anon_peak'] - r['anon_before']) / GIB:+.3f}); wrote "
                          f"{r['wrote'] / GIB:.3f} GiB; {r['seconds']:.1f} s; step "
                          f"{r['step']}", flush=True)
    print("\nper-rank peak RSS over the rank's share (median over ranks and rounds):")
    for way in ways:
        print(f"  {way:6s} {statistics.median(over[way]):.2f} x")
    if set(WAYS) <= set(ways):
        ratio = statistics.median(over["direct"]) / statistics.median(over["copy"])
        print(f"  direct/copy: {ratio:.2f} x")


if __name__ == "__main__":
    main()
