"""Per-rank resident memory of a large model's save, snapshots, lost node and resume, in one run.

    .venv/bin/python benchmarks/state_at_scale.py                       # fsdp, 4 nodes -> 3
    .venv/bin/python benchmarks/state_at_scale.py --layout pp2          # pipeline 2 x fsdp 2
    .venv/bin/python benchmarks/state_at_scale.py --layout pp2 --gpus 2 --reshard-after-forward
    .venv/bin/python benchmarks/state_at_scale.py --embed 1024 --layers 16 --steps 5

A GPT of examples/gpt.py's shape (its output layer untied: weights tied across modules cannot be
built on the meta device), built on the meta device, trains with AdamW as an elastic job of 4
one-process nodes on this host (`mpt launch --nodes 3:4`, the rendezvous on a store of its own,
`--snapshot-every 1`, each node's snapshot store its own directory in /dev/shm (``--store-dir``),
`--host-memory lean`, fsdp). It saves a sharded checkpoint after step 1; once every node's
store holds the pieces of step ``--kill-after`` (its own and the previous node's copy), one
node is SIGKILLed with its store, and the 3 survivors resume from the peers' snapshot and train
to ``--steps``; with ``--no-snapshots`` they resume from the disk's step 1 instead (the
restore times side by side). Under ``--layout pp2`` (``--pipeline-stages 2,1``: 2 stages x fsdp
2 at 4 processes) the 3 survivors, which 2 stages do not divide, resume without a pipeline as
fsdp 3; with ``--gpus 2`` (2 nodes of 2 processes) the second node is killed and the 2
survivors resume as 2 stages x fsdp 1.

Each worker samples its resident set size (RSS) every 5 ms from before ``mpt.Runtime`` and
writes, per phase, the peak above the RSS it had before ``rt.setup``; its share is 16 bytes
(fp32 weight, gradient, Adam's two moments) per element of the parameters it holds. The goal of
docs/benchmarks.md: every rank's peak over the run <= 1.15 x share + 256 MiB (a gather of the
whole state on one rank would take it past 4 x). A benchmark, not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from sharded_memory import RssSampler
from state_memory import ALLOWANCE, SLACK

from mpt.launchers.spec import free_port

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
PROCESSES = 4
"""Ranks of the job before a node is lost."""
STORE = """import sys, time
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False)
time.sleep(36000)
"""
"""The rendezvous's store, a process of its own (``python -c STORE HOST PORT``): it outlives
any node the benchmark kills."""


def worker(args: argparse.Namespace) -> None:
    """One rank: train, save after step 1, snapshots every step (`mpt launch`'s flags)."""
    sampler = RssSampler()
    import torch
    from torch import nn

    import mpt

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    rt = mpt.Runtime()
    torch.manual_seed(0)
    config = GPTConfig(vocab=256, block=args.block, layers=args.layers, heads=args.heads,
                       embed=args.embed)
    with torch.device("meta"):
        model = GPT(config)
        model.out.head.weight = nn.Parameter(torch.empty(config.vocab, config.embed))
    before = sampler.reset()
    phases: dict[str, int] = {}

    def take() -> int:
        """The peak above ``before`` since the last phase; the next starts from now."""
        peak = sampler.peak
        sampler.reset()
        return peak - before

    began = time.perf_counter()
    model, _optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    setup = time.perf_counter()
    step = rt.resume()["step"]
    seconds = {"setup": setup - began, "resume": time.perf_counter() - setup}
    # What a restore from the peers filled in (mpt's own record of it; none from the disk)
    snapshots = rt._checkpoints.snapshots
    moved = dict(snapshots.moved) if snapshots is not None else {}
    phases["setup and resume"] = take()
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
               for p in model.parameters())
    out = Path(args.out)
    record = out / f"rank{rt.rank}-{os.getpid()}.json"

    def write() -> None:  # after every phase: a killed worker's figures stay
        record.write_text(json.dumps({"rank": rt.rank, "world": rt.world_size, "held": held,
                                      "before": before, "phases": phases,
                                      "seconds": seconds, "moved": moved}))

    write()
    generator = torch.Generator().manual_seed(1)
    while step < args.steps:
        x = torch.randint(0, config.vocab, (rt.batch_size, config.block), generator=generator)
        loss = rt.forward_backward(x, x, lambda logits, y: nn.functional.cross_entropy(
            logits.flatten(0, 1), y.flatten()))
        rt.step()  # and the snapshot of this step
        step += 1
        phases[f"step {step} (snapshot)"] = take()
        if step == 1:
            rt.save(step=step)
            phases["save"] = take()
        write()
        if rt.rank == 0:
            with open(out / "curve.txt", "a") as f:
                f.write(f"{step} {rt.world_size} {float(loss):.6f}\n")
    rt.wait_for_save()
    rt.close()


def children(pid: int) -> list[int]:
    return [child.pid for child in psutil.Process(pid).children(recursive=True)]


def harness(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mpt-scale-"))
    shm = Path(tempfile.mkdtemp(prefix="mpt-scale-", dir=args.store_dir))
    out = tmp / "out"
    out.mkdir()
    port = free_port()
    store = subprocess.Popen([sys.executable, "-c", STORE, "127.0.0.1", str(port)])
    time.sleep(2)
    # 2 stages where they divide the world, none where they do not (3 processes)
    layout = ["--pipeline-stages", "2,1", "--microbatches", "2"] if args.layout == "pp2" else []
    if args.reshard_after_forward:
        layout += ["--fsdp-reshard-after-forward", "yes"]
    count = PROCESSES // args.gpus  # nodes
    nodes_range = f"{count - 1}:{count}"
    model = ["--embed", str(args.embed), "--layers", str(args.layers), "--heads",
             str(args.heads), "--block", str(args.block), "--batch", str(args.batch)]
    nodes = []
    for index in range(count):
        command = [sys.executable, "-m", "mpt", "launch", "--nodes", nodes_range,
                   "--gpus", str(args.gpus), "--master-port", str(port), "--backend", "fsdp",
                   *layout,
                   "--host-memory", "lean", "--global-batch-size", str(args.batch),
                   "--checkpoint-dir", str(tmp / "ck"),
                   *(["--snapshot-every", "1"] if args.snapshots else []),
                   "--snapshot-dir", str(shm / f"memory{index}"),
                   str(Path(__file__).resolve()), "--worker", str(out), "--steps",
                   str(args.steps), *model]
        nodes.append(subprocess.Popen(command, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    began = time.time()
    try:
        # the kill comes once every store holds its ranks' pieces of that step and their
        # copies (without snapshots: once the step is done)
        pieces = f"step-{args.kill_after:09d}.rank-*.snapshot"
        while not (out / "curve.txt").exists() or len(
                (out / "curve.txt").read_text().splitlines()) < args.kill_after or (
                args.snapshots and any(len(list((shm / f"memory{i}").glob(pieces)))
                                       < 2 * args.gpus for i in range(count))):
            time.sleep(0.5)
            ended = [node for node in nodes if node.poll() is not None]
            if ended or time.time() - began > 3600:
                raise RuntimeError("the job ended or hung before the step to kill at:\n"
                                   + "".join(node.communicate()[0][-3000:]
                                             for node in ended))
        victim = count - 1  # whichever ranks it holds: any node may be lost
        for pid in [*children(nodes[victim].pid), nodes[victim].pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(shm / f"memory{victim}", ignore_errors=True)
        print(f"killed node {victim} after step {args.kill_after}", flush=True)
        outputs = [node.communicate(timeout=7200)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        store.kill()
        shutil.rmtree(shm, ignore_errors=True)
    said = [line for text in outputs for line in text.splitlines()
            if "mpt: resumed" in line or "mpt: the snapshot" in line or "Error" in line]
    print("\n".join(dict.fromkeys(said)))
    if not (out / "curve.txt").exists():
        raise RuntimeError("the job trained no step:\n" + outputs[0][-4000:])
    print((out / "curve.txt").read_text())
    rows = [json.loads(path.read_text()) for path in out.glob("rank*.json")]
    for row in sorted(rows, key=lambda r: (-r["world"], r["rank"])):
        share = 16 * row["held"]
        bound = ALLOWANCE * share + SLACK
        peak = max(row["phases"].values())
        print(f"rank {row['rank']} of {row['world']} (setup {row['seconds']['setup']:.1f} s, "
              f"resume {row['seconds']['resume']:.1f} s): share {share / MiB:.0f} MiB, bound "
              f"{bound / MiB:.0f} MiB, RSS before setup {row['before'] / MiB:.0f} MiB, peak "
              f"above it {peak / MiB:.0f} MiB = {peak / share:.2f} x share "
              f"({'within' if peak <= bound else 'OVER'} the bound)")
        if row["moved"]:
            print(f"    restored from the peers: {row['moved']['read'] / MiB:.0f} MiB from its "
                  f"own store, {row['moved']['received'] / MiB:.0f} MiB received "
                  f"({sum(row['moved'].values()) / share:.2f} x share in all)")
        for name, value in row["phases"].items():
            print(f"    {name:22s} +{value / MiB:6.0f} MiB")
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=("fsdp", "pp2"), default="fsdp")
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=1,
                        help="processes per node: 4 nodes of 1, or 2 nodes of 2")
    parser.add_argument("--embed", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=12, help="sequences per step, over every "
                        "rank (12 divides over 4, 3 and 2 replicas)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kill-after", type=int, default=2)
    parser.add_argument("--reshard-after-forward", action="store_true",
                        help="--fsdp-reshard-after-forward yes (under a pipeline its default "
                        "is no: each stage's weights stay gathered across micro-batches)")
    parser.add_argument("--store-dir", default="/dev/shm", help="where the nodes' snapshot "
                        "stores go (default: memory); a disk's directory for a model whose "
                        "stores do not fit beside its ranks")
    parser.add_argument("--no-snapshots", dest="snapshots", action="store_false",
                        help="no --snapshot-every: the survivors resume from the disk")
    args = parser.parse_args()
    if args.worker:
        args.out = args.worker
        worker(args)
    else:
        harness(args)


if __name__ == "__main__":
    main()
