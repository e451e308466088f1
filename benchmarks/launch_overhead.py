"""Wall time of `mpt launch --gpus N` against `torchrun --nproc_per_node N`, same script.

The script does one allreduce and exits, so what is timed is the launch: the launcher's start,
its imports, the rendezvous, the workers' start and their teardown. Runs alternate (torchrun,
mpt, torchrun, ...) so that a machine getting busier weighs on both sides; the figure is the
median of the per-pair ratios mpt/torchrun (goal: <= 1.05). It also prints the ratio of the CPU
seconds each launch used (launcher and workers, user + system): on a machine other jobs load,
that one moves less than the wall time. Not a test: it prints figures.

    .venv/bin/python benchmarks/launch_overhead.py [--pairs 11] [--gpus 2] [--null]
                                                   [--cached-bytecode]

``--null`` times torchrun against itself: the ratio is the noise floor of the machine at hand.

``--cached-bytecode`` runs both sides with their modules' bytecode cached (in a temporary
``PYTHONPYCACHEPREFIX``), as in an installed package. Without it the environment decides: under
``PYTHONDONTWRITEBYTECODE=1`` an editable install of mpt compiles every mpt module it imports in
every process (launcher and each worker), while torch's modules come compiled from its wheel.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
assert tensor.item() == dist.get_world_size()
dist.destroy_process_group()
"""

BIN = Path(sys.executable).parent


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def commands(script: Path, gpus: int, null: bool) -> dict[str, list[str]]:
    """The two sides, each a command that starts ``gpus`` processes of ``script`` on gloo."""
    torchrun = [str(BIN / "torchrun"), "--nproc_per_node", str(gpus), "--master_port", "{port}",
                str(script)]
    mpt = [str(BIN / "mpt"), "launch", "--gpus", str(gpus), "--master-port", "{port}",
           str(script)]
    return {"torchrun": torchrun, "mpt launch": torchrun if null else mpt}


def cpu_seconds() -> float:
    """User + system seconds of the children waited for so far (a launcher counts its
    workers, which it waits for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def environment(bytecode_cache: str | None) -> dict[str, str]:
    """Both sides' environment: one OpenMP thread per process; with ``bytecode_cache``, every
    module's bytecode written to and read from that folder."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if bytecode_cache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = bytecode_cache
    return env


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds from start to exit of ``command``; its failure stops the run."""
    port = str(free_port())
    cpu, start = cpu_seconds(), time.perf_counter()
    result = subprocess.run([part.replace("{port}", port) for part in command],
                            capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if result.returncode:
        sys.exit(f"launch_overhead: {command[0]} failed ({result.returncode}):\n"
                 f"{result.stderr[-2000:]}")
    return seconds, cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=11, help="paired runs (default 11)")
    parser.add_argument("--gpus", type=int, default=2, help="processes per launch (default 2)")
    parser.add_argument("--null", action="store_true", help="torchrun against itself")
    parser.add_argument("--cached-bytecode", action="store_true",
                        help="both sides with their bytecode cached, as installed packages")
    args = parser.parse_args()
    load_before = f"{os.getloadavg()[0]:.1f}"
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "one_allreduce.py"
        script.write_text(SCRIPT)
        sides = commands(script, args.gpus, args.null)
        env = environment(str(Path(folder) / "pycache") if args.cached_bytecode else None)
        for command in sides.values():  # warm the page cache and any first-use compilation
            timed(command, env)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for pair in range(args.pairs):
            order = list(sides) if pair % 2 == 0 else list(reversed(sides))
            for name in order:
                times[name].append(timed(sides[name], env))
    bytecode = "cached" if args.cached_bytecode else (
        "compiled in each process (PYTHONDONTWRITEBYTECODE=1)"
        if os.environ.get("PYTHONDONTWRITEBYTECODE") else "as the environment caches it")
    print(f"bytecode: {bytecode}; load average before/after: {load_before} / "
          f"{os.getloadavg()[0]:.1f}")
    for name, values in times.items():
        print(f"{name:>10}: median {statistics.median(w for w, _ in values):.2f} s wall "
              f"({', '.join(f'{w:.2f}' for w, _ in values)}), "
              f"{statistics.median(c for _, c in values):.2f} s CPU")
    for kind, at in (("wall", 0), ("CPU", 1)):
        ratios = [m[at] / t[at] for m, t in zip(times["mpt launch"], times["torchrun"],
                                                strict=True)]
        print(f"ratio mpt launch / torchrun, {kind} time, over {args.pairs} pairs ({args.gpus} "
              f"processes{', null' if args.null else ''}): median "
              f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
              + ("; goal <= 1.05" if kind == "wall" else ""))


if __name__ == "__main__":
    main()
