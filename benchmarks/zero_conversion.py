"""Converting a ZeRO-3 checkpoint: ``mpt checkpoint convert`` against DeepSpeed's ``zero_to_fp32``.

Build the source with DeepSpeed alone (a plain ZeRO-3 script, no mpt, 4 CPU processes started by
``torchrun``), then measure both conversions of the same directory in one run::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/tmp/ds-ext \\
        .venv/bin/python benchmarks/zero_conversion.py --make /tmp/zc/ds   # 352 M parameters
    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/zero_conversion.py --measure /tmp/zc/ds \\
        [--rounds 2] [--max-load 1.5]
    .venv/bin/python benchmarks/zero_conversion.py --make /tmp/zc/tiny --layers 4 --width 256 \\
        && .venv/bin/python benchmarks/zero_conversion.py --measure /tmp/zc/tiny --rounds 1  # smoke

``--make DIR`` runs ``torchrun --nproc-per-node 4`` on this file's worker: ``deepspeed.zero.Init``
builds ``--layers`` x ``nn.Linear(width, width)`` in fp32 (21 x 4096: 352.4 M parameters), with
``torch.optim.AdamW`` as the client optimizer, the ZeRO-3 config of ``zero3_low_memory.json``
(small buckets), micro-batch 1, ``--steps`` training steps, then ``engine.save_checkpoint(DIR)``.

``--measure DIR`` times, one at a time, each in its own subprocess, alternating the order every
round:

- **deepspeed**: DeepSpeed's own conversion, the ``zero_to_fp32.py`` that ``save_checkpoint``
  copied into DIR (``python DIR/zero_to_fp32.py DIR OUT``); where ``huggingface_hub`` (which
  that CLI needs for its default ``--max_shard_size 5GB``) is missing, the same file's
  ``convert_zero_checkpoint_to_fp32_state_dict(DIR, OUT, max_shard_size=None)`` (one
  ``pytorch_model.bin``: what the CLI writes anyway for a model under 5 GB). fp32 weights only.
- **mpt**: ``mpt checkpoint convert DIR OUT``: the whole training state (weights, AdamW moments
  by parameter name, step, param groups).
- **mpt-weights**: ``mpt checkpoint convert --weights-only DIR OUT``: the weights alone, like for
  like with DeepSpeed's;
- **floor**: ``python -c 'import torch'``, what every one of them holds before it reads anything
  (torch's shared libraries count in RSS): the ratios are also printed above it.

Memory: a sampler reads VmRSS, RssAnon and RssFile from /proc/PID/status of the subprocess and
every descendant (re-listed every 100 ms) every 10 ms and keeps the peak of their sums; the
subprocess's own ``ru_maxrss`` (``os.wait4``: its peak RSS, exact, kernel-kept; the largest
of it and its waited-for children) is printed beside it. RSS counts the pages of memory-mapped
checkpoint files a tool has touched (RssFile) as well as its own allocations (RssAnon):
DeepSpeed maps the rank files whole (``torch.load(mmap=True)``); mpt reads only their pickled
structure, then reads the bytes it copies into a few reused 4 MiB buffers (``preadv``) and
writes them with ``O_DIRECT``: nothing of the sources or the output is mapped. Before each
measured run the tag folder is read once (untimed) so both tools find it in the page cache, the
previous output is deleted, and the run waits (up to ``--wait`` s) for the 1-minute load
average to fall below ``--max-load``; a run that had to start above it is marked. Wall time
is the subprocess's start to its exit (interpreter start and imports included); CPU time is its
user + system time.

Prints per tool the median (and each round's) peak RSS, wall and CPU time, and the ratios
mpt/deepspeed and mpt-weights/deepspeed against issue 35's goal (peak RSS <= 0.5 x, time <=
1.0 x). A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 1024 ** 3
GOAL_RSS, GOAL_TIME = 0.5, 1.0

DS_WRAPPER = """\
import runpy, sys
ns = runpy.run_path(sys.argv[1] + "/zero_to_fp32.py", run_name="zero_to_fp32")
ns["convert_zero_checkpoint_to_fp32_state_dict"](sys.argv[1], sys.argv[2], max_shard_size=None)
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--make", metavar="DIR", help="build a DeepSpeed ZeRO-3 checkpoint in DIR")
    mode.add_argument("--measure", metavar="DIR", help="measure both conversions of DIR")
    mode.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)  # one torchrun rank
    parser.add_argument("--layers", type=int, default=21)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1, help="training steps before the save")
    parser.add_argument("--nproc", type=int, default=4, help="processes that save (--make)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per tool (--measure)")
    parser.add_argument("--tools", default="floor,deepspeed,mpt,mpt-weights",
                        help="floor: `python -c 'import torch'`, the start-up every tool pays")
    parser.add_argument("--out", help="where the conversions write (default: DIR + '-out')")
    parser.add_argument("--max-load", type=float, default=1.5,
                        help="wait for the 1-minute load average to fall below this")
    parser.add_argument("--wait", type=float, default=600, help="longest wait for it, seconds")
    return parser.parse_args()


# ---------------------------------------------------------------- the source: DeepSpeed alone

def make(args: argparse.Namespace) -> None:
    """torchrun this file's worker on ``--nproc`` CPU processes."""
    Path(args.make).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/ds-ext")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone",
           f"--nproc-per-node={args.nproc}", __file__, "--worker", args.make,
           "--layers", str(args.layers), "--width", str(args.width), "--steps", str(args.steps)]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    print(f"--make: exit {rc} after {time.perf_counter() - start:.1f} s", flush=True)
    if rc == 0:
        tag = Path(args.make) / Path(args.make, "latest").read_text().strip()
        for f in sorted(tag.iterdir()):
            print(f"  {f.name}: {f.stat().st_size / GIB:.3f} GiB")
    sys.exit(rc)


def worker(args: argparse.Namespace) -> None:
    """One rank of a plain DeepSpeed ZeRO-3 script: build, train ``--steps`` steps, save."""
    import deepspeed
    import torch
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    config = json.loads((HERE / "zero3_low_memory.json").read_text())
    config.update({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True})
    torch.manual_seed(0)
    # dtype left to the config (fp32 here): an explicit dtype=torch.float32 becomes bf16 on a
    # CPU in DeepSpeed 0.19.8 (``Init._set_dtype``: ``dtype or fp16 if ... else bf16 ...``)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params = sum(p.ds_numel for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        t = time.perf_counter()
        x = torch.randn(1, args.width, generator=gen)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4g}, {time.perf_counter() - t:.1f} s",
                  flush=True)
    engine.save_checkpoint(args.worker, client_state={"step": args.steps})
    if rank == 0:
        print(f"saved {params / 1e6:.1f} M parameters from {torch.distributed.get_world_size()} "
              f"ranks to {args.worker}", flush=True)
    torch.distributed.barrier()


# ---------------------------------------------------------------- measuring

def _status(pid: int) -> tuple[int, int, int] | None:
    """VmRSS, RssAnon, RssFile of ``pid`` in bytes (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            found[key] = int(value.split()[0]) * 1024
    if "VmRSS" not in found:  # a zombie
        return None
    return found["VmRSS"], found.get("RssAnon", 0), found.get("RssFile", 0)


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc/*/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            pass
    return out


def measured(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``cmd``; its wall and CPU time, peak RSS of its tree (sampled) and its ru_maxrss."""
    with tempfile.TemporaryFile() as log:  # not a pipe: a chatty tool must never block on it
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        peak = peak_anon = peak_file = 0
        pids, listed = [proc.pid], 0.0
        while True:
            done, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if done:
                break
            now = time.perf_counter()
            if now - listed > 0.1:
                pids, listed = _descendants(proc.pid), now
            rss = anon = file = 0
            for pid in pids:
                got = _status(pid)
                if got:
                    rss, anon, file = rss + got[0], anon + got[1], file + got[2]
            peak, peak_anon = max(peak, rss), max(peak_anon, anon)
            peak_file = max(peak_file, file)
            time.sleep(0.01)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read().decode(errors="replace")
    if proc.returncode != 0:
        print(output[-3000:])
        raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_gib": peak / GIB, "anon_gib": peak_anon / GIB, "file_gib": peak_file / GIB,
            "maxrss_gib": usage.ru_maxrss * 1024 / GIB, "tail": output.strip()[-200:]}


def wait_for_quiet(max_load: float, longest: float) -> tuple[float, bool]:
    """The 1-minute load average once below ``max_load`` (or after ``longest`` s), and whether
    it was below."""
    deadline = time.monotonic() + longest
    while True:
        load = os.getloadavg()[0]
        if load < max_load:
            return load, True
        if time.monotonic() > deadline:
            return load, False
        print(f"  load {load:.2f} >= {max_load}: waiting", flush=True)
        time.sleep(15)


def warm(folder: Path) -> None:
    """Read every file of the tag folder once, so each run finds it in the page cache."""
    for f in folder.iterdir():
        if f.is_file():
            with f.open("rb") as fh:
                while fh.read(1 << 24):
                    pass


def commands(src: Path, out: Path) -> dict[str, list[str]]:
    py = sys.executable
    mpt = Path(py).with_name("mpt")
    mpt_cmd = [str(mpt)] if mpt.exists() else [shutil.which("mpt") or "mpt"]
    if importlib.util.find_spec("huggingface_hub") is not None:
        ds = [py, str(src / "zero_to_fp32.py"), str(src), str(out)]
    else:
        ds = [py, "-c", DS_WRAPPER, str(src), str(out)]
    return {"floor": [py, "-c", "import torch"],  # what any of them holds after importing torch
            "deepspeed": ds,
            "mpt": [*mpt_cmd, "checkpoint", "convert", str(src), str(out)],
            "mpt-weights": [*mpt_cmd, "checkpoint", "convert", "--weights-only", str(src),
                            str(out)]}


def du(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / GIB


def measure(args: argparse.Namespace) -> None:
    src = Path(args.measure).resolve()
    tag = src / (src / "latest").read_text().strip()
    out = Path(args.out or f"{src}-out").resolve()
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    tools = args.tools.split(",")
    cmds = commands(src, out)
    print(f"source {tag}: {du(tag):.2f} GiB in {len(list(tag.iterdir()))} files", flush=True)
    wrapper = ("<runpy DIR/zero_to_fp32.py; convert_zero_checkpoint_to_fp32_state_dict(DIR, OUT,"
               " max_shard_size=None)>")
    for name in tools:
        print(f"  {name}: " + " ".join(wrapper if c == DS_WRAPPER else c for c in cmds[name]))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in tools}
    for rnd in range(args.rounds):
        order = tools if rnd % 2 == 0 else tools[::-1]
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            warm(tag)
            load, quiet = wait_for_quiet(args.max_load, args.wait)
            r = measured(cmds[name], env)
            r.update(load=load, quiet=quiet, out_gib=du(out))
            runs[name].append(r)
            print(f"round {rnd + 1} {name:12s} peak RSS {r['peak_gib']:.3f} GiB (anon "
                  f"{r['anon_gib']:.3f}, file {r['file_gib']:.3f}; ru_maxrss "
                  f"{r['maxrss_gib']:.3f}) wall {r['wall_s']:.2f} s cpu {r['cpu_s']:.2f} s; "
                  f"wrote {r['out_gib']:.3f} GiB; load {load:.2f}"
                  f"{'' if quiet else ' (UNDER LOAD)'}", flush=True)
    shutil.rmtree(out, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    print("\nmedians over", args.rounds, "round(s)")
    print(f"{'tool':12s} {'peak RSS GiB':>12s} {'anon':>7s} {'file':>7s} {'ru_maxrss':>9s} "
          f"{'wall s':>8s} {'cpu s':>8s} {'out GiB':>8s}")
    for name in tools:
        print(f"{name:12s} {med(name, 'peak_gib'):12.3f} {med(name, 'anon_gib'):7.3f} "
              f"{med(name, 'file_gib'):7.3f} {med(name, 'maxrss_gib'):9.3f} "
              f"{med(name, 'wall_s'):8.2f} {med(name, 'cpu_s'):8.2f} "
              f"{med(name, 'out_gib'):8.3f}")
    if "deepspeed" in tools:
        for name in [t for t in tools if t not in ("deepspeed", "floor")]:
            rss = med(name, "peak_gib") / med("deepspeed", "peak_gib")
            anon = med(name, "anon_gib") / med("deepspeed", "anon_gib")
            wall = med(name, "wall_s") / med("deepspeed", "wall_s")
            print(f"{name}/deepspeed: peak RSS {rss:.2f} x (goal <= {GOAL_RSS}: "
                  f"{'met' if rss <= GOAL_RSS else 'NOT met'}; anonymous only {anon:.2f} x), "
                  f"wall {wall:.2f} x (goal <= {GOAL_TIME}: "
                  f"{'met' if wall <= GOAL_TIME else 'NOT met'})")
            if "floor" in tools:
                base = med("floor", "peak_gib")
                above = (med(name, "peak_gib") - base) / (med("deepspeed", "peak_gib") - base)
                print(f"  above the floor's {base:.3f} GiB: peak RSS {above:.2f} x")
    if not all(r["quiet"] for rs in runs.values() for r in rs):
        print(f"note: some runs started with the load average at or above {args.max_load}")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
    elif args.make:
        make(args)
    else:
        measure(args)


if __name__ == "__main__":
    main()
