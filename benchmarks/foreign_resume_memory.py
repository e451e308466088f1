"""What each rank holds while ``rt.load`` imports another framework's checkpoint under fsdp.

The source is ``--layers`` x ``nn.Linear(width, width)`` trained one step with AdamW, either by
DeepSpeed alone at ZeRO-3 (``zero_conversion.py --make``) or by a plain FSDP2 script that saves
``get_state_dict``'s model and optimizer with ``dcp.save`` (``--make-dcp DIR``: this file
under ``torch.distributed.run``, ``--nproc`` gloo ranks, nothing of mpt), then measure::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/tmp/ds-ext .venv/bin/python \\
        benchmarks/zero_conversion.py --make /tmp/fr/ds --layers 21 --nproc 2   # 352 M
    .venv/bin/python benchmarks/foreign_resume_memory.py /tmp/fr/ds --layers 21 [--gpus 2]
    .venv/bin/python benchmarks/foreign_resume_memory.py --make-dcp /tmp/fr/dcp --layers 21
    .venv/bin/python benchmarks/foreign_resume_memory.py /tmp/fr/dcp --layers 21 --ways direct

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
back), the bytes it wrote to disk and the bytes it read (``/proc/self/io``: ``rchar``, every
read() and pread(), from the page cache too). The two ways alternate in order
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
    parser.add_argument("source", nargs="?", help="a DeepSpeed ZeRO checkpoint directory "
                        "(zero_conversion.py --make's) or a DCP one (--make-dcp's)")
    parser.add_argument("--layers", type=int, default=21)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--gpus", type=int, default=2, help="processes of the resuming run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--make-dcp", metavar="DIR", help="write a plain FSDP2 script's DCP "
                        "checkpoint into DIR and stop")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of --make-dcp's script")
    parser.add_argument("--dcp-writer", action="store_true", help=argparse.SUPPRESS)
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


def _io(key: str) -> int:
    """This process's ``/proc/self/io`` count ``key`` (``write_bytes``, ``rchar``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    return 0


def _written() -> int:
    return _io("write_bytes")


def write_dcp(args: argparse.Namespace) -> None:
    """One rank of a plain FSDP2 script (no mpt): ``fully_shard`` each layer and the model,
    one AdamW step, then ``dcp.save`` of ``get_state_dict``'s model and optimizer."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, args.width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    weights, state = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "optimizer": state, "train_state": {"step": 1, "epoch": 0}},
             checkpoint_id=args.make_dcp)
    dist.barrier()
    dist.destroy_process_group()


def make_dcp(args: argparse.Namespace) -> None:
    """``--make-dcp``: this file's ``write_dcp`` at ``--nproc`` ranks (torch.distributed.run)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc), __file__, "--make-dcp", args.make_dcp, "--dcp-writer",
           "--layers", str(args.layers), "--width", str(args.width)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    size = sum(p.stat().st_size for p in Path(args.make_dcp).iterdir())
    print(f"{args.make_dcp}: {size / GIB:.3f} GiB in {time.perf_counter() - start:.0f} s")


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
    wrote, read = _written(), _io("rchar")
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
              "wrote": _written() - wrote, "read": _io("rchar") - read, "seconds": seconds}
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
    if args.dcp_writer:
        write_dcp(args)
        return
    if args.make_dcp:
        make_dcp(args)
        return
    if args.source is None:
        raise SystemExit("pass SOURCE, or --make-dcp DIR")
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
                          f"{r['wrote'] / GIB:.3f} GiB, read {r['read'] / GIB:.3f} GiB; "
                          f"{r['seconds']:.1f} s; step "
                          f"{r['step']}", flush=True)
    print("\nper-rank peak RSS over the rank's share (median over ranks and rounds):")
    for way in ways:
        print(f"  {way:6s} {statistics.median(over[way]):.2f} x")
    if set(WAYS) <= set(ways):
        ratio = statistics.median(over["direct"]) / statistics.median(over["copy"])
        print(f"  direct/copy: {ratio:.2f} x")


if __name__ == "__main__":
    main()
