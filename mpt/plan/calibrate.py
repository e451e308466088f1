"""`mpt plan --calibrate`: measure this machine's figures for the cost model, and load them.

Two real processes (``torch.multiprocessing``, gloo on a CPU, NCCL on GPUs) each as `mpt
launch` starts a rank (one intra-op thread):

1. a sweep of allreduce, all-gather and reduce-scatter sizes between them, each fitted by least
   squares to ``t = latency + ring factor x size / bus bandwidth`` (nccl-tests' busbw);
2. then every rank at once (each shares the machine as it will while training), rank 0's
   figures kept: square matmuls per dtype (float32, bfloat16, float16), the bandwidth of a
   large copy, and the time of a one-element op (the dispatch overhead). Each figure is the
   median of a few timings after a warm-up.

The file keeps the machine's identity (host name, CPU model, device name, torch); a file from
another machine is refused where it is loaded. Only one machine is measured: the inter-node
link still comes from ``--link``.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpt.errors import UsageError
from mpt.plan.network import ring_factor, ring_steps
from mpt.plan.profiles import CollectiveFit, Device, Link

FORMAT = "mpt-plan-calibration/1"
SIZES = (1 << 14, 1 << 18, 1 << 21, 1 << 23)
"""Bytes per collective in the sweep: from latency-bound to bandwidth-bound, under a second."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """What was measured, and where."""

    identity: dict[str, str]
    """The machine's identity (``identity()``)."""
    ranks: int
    """Processes the collectives ran between."""
    backend: str
    """The process group's backend: gloo or nccl."""
    flops: dict[str, float]
    """Matmul FLOP/s by dtype name."""
    memory_bandwidth: float
    """Bytes per second of a large copy (read + write)."""
    op_overhead: float
    """Seconds of a one-element op."""
    memory: float
    """Bytes one rank may fill: the device's memory, or the host's over the ranks."""
    collectives: dict[str, dict[str, float]]
    """By collective: ``latency`` (s per ring step) and ``bus_bandwidth`` (bytes/s)."""

    def device(self, source: str) -> Device:
        """The cost model's device from these figures; ``source`` names the file."""
        fits = {name: CollectiveFit(**fit) for name, fit in self.collectives.items()}
        ring = fits["all_reduce"]
        return Device(name=f"calibrated {self.identity['device']}", flops=self.flops,
                      memory_bandwidth=self.memory_bandwidth, memory=self.memory,
                      intra_node=Link(name=f"calibrated {self.backend}",
                                      bandwidth=ring.bus_bandwidth, latency=ring.latency,
                                      source=source),
                      op_overhead=self.op_overhead,
                      # gloo's collectives run on the cores that compute (no engine of their
                      # own): docs/benchmarks.md's scaling runs show nothing hidden on them.
                      overlap=0.0 if self.backend == "gloo" else 1.0,
                      collectives=fits, source=source,
                      device_type="cpu" if self.backend == "gloo" else "cuda")


def cpu_name() -> str:
    """This machine's CPU model, as /proc/cpuinfo names it (else the platform's word)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def identity() -> dict[str, str]:
    """This machine: host name, CPU model, accelerator, torch."""
    cpu = cpu_name()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"host": socket.gethostname(), "cpu": cpu, "device": device,
            "torch": torch.__version__}


def fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares of ``t = a + x / bw`` over (x = ring bytes, t) points."""
    xs, ts = zip(*points, strict=True)
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mx) * (t - mt) for x, t in points) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return {"latency": max(0.0, mt - slope * mx), "bus_bandwidth": 1.0 / slope}


def _timed(run: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """The median of ``repeats`` timings after one warm-up."""
    run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sweep(world: int, device: torch.device, sync: Callable[[], None]
          ) -> dict[str, dict[str, float]]:
    """Every collective's fit over ``SIZES`` (collective: every rank calls it)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    points: dict[str, list[tuple[float, float]]] = {"all_reduce": [], "all_gather": [],
                                                     "reduce_scatter": []}
    for size in SIZES:
        whole = torch.ones(size // 4, device=device)
        part = torch.ones(size // 4 // world, device=device)
        runs = {"all_reduce": lambda whole=whole: dist.all_reduce(whole),
                "all_gather": lambda whole=whole, part=part: gather(whole, part),
                "reduce_scatter": lambda whole=whole, part=part: scatter(part, whole)}
        for name, run in runs.items():
            seconds = _timed(run, 5, sync)
            points[name].append((ring_factor(name, world) * size, seconds))
    # the fit's intercept is the whole collective's fixed cost: per ring step, as the cost
    # model (mpt.plan.network.collective) multiplies it by the steps
    fits = {name: fit(found) for name, found in points.items()}
    for name, found in fits.items():
        found["latency"] /= ring_steps(name, world)
    return fits


def device_figures(device: torch.device, sync: Callable[[], None]) -> dict[str, Any]:
    """This rank's matmul FLOP/s by dtype, copy bandwidth and op overhead. Every rank measures
    at once, so that each shares the machine as it does while training."""
    n = 4096 if device.type == "cuda" else 512
    flops = {}
    for dtype in DTYPES:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        flops[str(dtype).removeprefix("torch.")] = 2 * n**3 / _timed(lambda a=a, b=b: a @ b,
                                                                     3, sync)
    src = torch.ones(1 << 24, device=device)  # 64 MiB: beyond any cache
    dst = torch.empty_like(src)
    copy = _timed(lambda: dst.copy_(src), 5, sync)
    one = torch.ones(1, device=device)
    overhead = _timed(lambda: [one.add_(1) for _ in range(200)], 3, sync) / 200
    return {"flops": flops, "memory_bandwidth": 2 * src.nbytes / copy,
            "op_overhead": overhead}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # as `mpt launch` starts each rank
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        collectives = sweep(world, device, sync)
        dist.barrier()
        figures = device_figures(device, sync)
    finally:
        dist.destroy_process_group()
    if rank:
        return
    memory = (torch.cuda.get_device_properties(device).total_memory if cuda
              else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world)
    Path(out).write_text(json.dumps({
        "ranks": world, "backend": "nccl" if cuda else "gloo", "collectives": collectives,
        "memory": memory, **figures}))


def measure(ranks: int = 2) -> Calibration:
    """Measure this machine with ``ranks`` processes."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "figures.json")
        mp.spawn(_worker, args=(ranks, port, out), nprocs=ranks, join=True)
        figures = json.loads(Path(out).read_text())
    return Calibration(identity=identity(), **figures)


def save(calibration: Calibration, path: Path) -> None:
    from dataclasses import asdict

    path.write_text(json.dumps({"format": FORMAT, **asdict(calibration)}, indent=2) + "\n")


def load(path: Path) -> Calibration:
    """The calibration in ``path``; a UsageError for a missing or foreign file, or one made on
    another machine."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError("--calibration", path, f"it cannot be read ({exc})",
                         "pass a file written by `mpt plan --calibrate --output FILE`") from None
    if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
        raise UsageError("--calibration", path, f"it is not a {FORMAT} file",
                         "pass a file written by `mpt plan --calibrate --output FILE`")
    found = Calibration(**data)
    here = identity()
    differ = [key for key in ("host", "cpu", "device") if found.identity.get(key) != here[key]]
    if differ:
        key = differ[0]
        raise UsageError("--calibration", path, f"it was measured on {key} "
                         f"{found.identity.get(key)!r}, and this is {here[key]!r}",
                         "run `mpt plan --calibrate` on this machine, or use --device for a "
                         "datasheet profile")
    return found
