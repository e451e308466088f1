"""`mpt plan --calibrate`: measure this machine's figures for the cost model, and load them.

``--gpus`` real processes, at least 2 on one machine (``torch.multiprocessing``, gloo on a
CPU, NCCL on GPUs), each as `mpt launch` starts a rank (one intra-op thread) and, on a CPU, as
the plan's launch line there runs it (``--host-memory steady``: jemalloc, where the machine has
it, or glibc keeps every block it served, so that no step faults memory in again):

1. a sweep of allreduce, all-gather and reduce-scatter sizes (16 KiB - 32 MiB) between them,
   the allreduce and the reduce-scatter also in bf16 and fp16, each fitted by least squares
   to ``t = latency + ring factor x size / bus bandwidth`` (nccl-tests' busbw);
2. then as many ranks of each node at once as will train there (``--gpus``: the rest wait), so
   that each shares the machine as it will while training, each timing but the matmuls'
   begun on all of them together (as a training step's collectives begin each phase), rank
   0's figures kept: per dtype (float32, bfloat16, float16), matmuls of ``N`` x ``N``
   weights whose smallest dimension sweeps ``SMALLEST`` then ``N``, both with few rows
   (``s x N @ N x N``: a forward, an input gradient) and a short inner dimension
   (``N x s @ s x N``: a weight gradient), on operands rotated through more memory than the
   caches hold, as a training step streams each weight from memory; the bandwidth of a
   large copy; the time of a one-element op (the dispatch overhead); and the seconds per
   parameter of each optimizer's torch step (its default path on the device: single-tensor
   on a CPU, foreach on CUDA); beside a GPU, what offloading pays (``host_figures``): the
   copy rate between pinned host memory and the device, each way, and the optimizer steps
   over host tensors. Each figure is the median of a few timings after a warm-up.
3. with a model (`mpt plan FILE.py:FUNCTION --calibrate`), by the same ranks: that model's own
   training step, built on the device at the per-rank micro-batch (``StepSpec``): its forward
   and backward, the same samples cut into 2, 4, 8 and 16 micro-batches that accumulate
   (``SPLITS``), and its optimizer step with ``zero_grad``, each the median of three spells of
   ``STEP_REPEATS`` timings (``ModelStep``), after ``STEP_WARMUP`` steps: one before step 1,
   one between steps 1 and 2, one after step 2. What the op-by-op model leaves out on this device
   (a kernel's real speed at the model's own shapes)
   is in these two figures; the plan scales its compute by them (``MeasuredStep``). Last, in
   processes of their own, each training rank in a world of its own, the step as
   ``mpt.Runtime`` trains it under each backend's ``timed_alone`` options (fsdp's
   ``fully_shard``, DeepSpeed ZeRO-3), of the micro-batch whole and cut in two
   (``alone_steps``): what their hooks, DTensor parameters and copies add, which the plan's
   layouts under those options pay beyond the copies it prices.

Across nodes (``--nodes N --nr R --master-addr HOST`` on every node, as `mpt launch` is
started), each node starts its ``--gpus`` processes and all of them meet in one process group:
step 1 runs within each node (where a node has 2 or more processes), then the same sweep runs
over every rank of every node (the link between the nodes, as nccl-tests' busbw measures it
across hosts); node 0 writes the file. A node of one process has no collective of its own: its
figures are the link's.

The file keeps the machine's identity (host name, CPU model, device name, torch) and every
node's host name; a file from another machine is refused where it is loaded, and so is one of
an older format.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from mpt.environments.host_memory import apply_host_memory, host_memory_env
from mpt.environments.world import World
from mpt.errors import UsageError
from mpt.plan.network import fit_key, ring_factor, ring_steps
from mpt.plan.profiles import (
    CPU_HOST_MEMORY,
    BackendStep,
    CollectiveFit,
    Device,
    Link,
    MeasuredStep,
    StepSpec,
)
from mpt.plan.workload import MODEL_ERRORS
from mpt.precision.base import dtype_name

FORMAT = "mpt-plan-calibration/2"
"""Version 2 added ``matmul_sweep`` and ``update_seconds``."""
SIZES = (1 << 14, 1 << 18, 1 << 21, 1 << 23, 1 << 25)
"""Bytes per collective in the sweep: from latency-bound to bandwidth-bound and as large as
what training sends (DDP's 25 MiB buckets, fsdp's units): beyond the caches, a message moves
slower than one of 8 MiB (here 13.6 ms for a 16.8 MB all-gather against 6.6-8 ms from a sweep
that stopped at 8 MiB)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SWEPT_16 = (torch.bfloat16, torch.float16)
"""The 16-bit dtypes the sweep reduces in beside fp32 (all-gathers move bytes alike in any)."""
SMALLEST = (1, 4, 16, 64, 256)
"""The smallest matmul dimensions swept (a batch's rows; then the square's ``N``)."""
COLD_BYTES = 1 << 26
"""Bytes each matmul timing rotates its operands through: twice this machine's L3 (32 MiB)."""
SLOW = 0.05
"""Seconds of one matmul above which its timing needs no cold copies (and takes no repeats)."""
MEET_TIMEOUT = 300
"""Seconds the nodes wait for each other (at the start, and in each collective) before a
calibration fails instead of hanging."""
HOROVOD_DEADLINE = 900
"""Seconds Horovod's sweep may take (``horovod_fits``; 4 nodes at 1 Gbit/s took minutes)
before the calibration goes on without it."""
OPTIMIZERS: dict[str, tuple[str, dict[str, float]]] = {
    "adam": ("Adam", {}), "adamw": ("AdamW", {}), "sgd": ("SGD", {}),
    "sgd-momentum": ("SGD", {"momentum": 0.9}), "rmsprop": ("RMSprop", {}),
    "adagrad": ("Adagrad", {})}
"""``--optimizer`` names as torch.optim classes and their arguments besides ``lr``."""
STEP_WARMUP, STEP_REPEATS = 2, 5
"""Steps of the model's own step run before timing (state, caches, the allocator's threshold
settle), then timed."""
Parts = tuple[Callable[[int], None], Callable[[], None]]
"""A model's two timed parts: its forward and backward over the micro-batch cut into as many
pieces as it is given, and its optimizer step with ``zero_grad``."""
PROBE_MICROBATCHES, PROBE_WIDTH = 8, 64
"""The pipeline probe's micro-batches and its chunks' width (one Linear each: its compute is
next to nothing against the schedule's own work)."""
SPLITS = (2, 4, 8, 16)
"""The model's micro-batch is also timed cut into this many pieces, each's forward and
backward accumulating into the gradients (where the count divides it): a pipeline's
micro-batches, or `--accumulate`'s, are smaller, and a small one runs below what its ops
price (the backward's matmuls of few rows, each gradient accumulated again)."""


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
    """Bytes one rank may fill: the device's memory, or the host's over the ranks that train."""
    collectives: dict[str, dict[str, Any]]
    """By collective: ``latency`` (s per ring step), ``bus_bandwidth`` (bytes/s) and
    ``rates`` (``[ring bytes, busbw]`` at each size swept; absent in files measured before)."""
    matmul_sweep: dict[str, dict[str, list[list[float]]]]
    """By dtype, ``rows`` and ``inner``: ``[smallest dimension, FLOP/s]`` pairs (``Device``)."""
    update_seconds: dict[str, float]
    """Seconds of torch's optimizer step per parameter, by ``--optimizer`` name."""
    nodes: int = 1
    """Nodes measured at once (1: this machine alone)."""
    hosts: list[str] = dataclasses.field(default_factory=list)
    """Every node's host name (empty in files measured before several nodes could be)."""
    link: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Like ``collectives``, over every rank of every node: the link between the nodes (empty
    for one node)."""
    model_step: dict[str, Any] = dataclasses.field(default_factory=dict)
    """A model's own step (``MeasuredStep``'s fields), where the calibration was given one;
    empty otherwise."""
    pipeline_overhead: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds each action of a pipeline schedule costs beyond its compute and its sends, by
    ``--pipeline-schedule`` (``pipeline_overheads``; empty in files measured before it was)."""
    host_link: float | None = None
    """Bytes per second each way between pinned host memory and a GPU (``host_figures``);
    None on a CPU, whose memory is the host's."""
    host_update_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Like ``update_seconds``, of the step over host tensors that an offloaded optimizer
    runs beside a GPU; empty on a CPU, where it is ``update_seconds``."""
    host_memory: float = 0.0
    """Beside GPUs, bytes of host memory one rank may offload into: the host's over the
    ranks that train; 0 on a CPU, where ``memory`` is the host's."""

    def measured_step(self) -> MeasuredStep | None:
        """The model's step this calibration timed, None where it timed none."""
        if not self.model_step:
            return None
        spec = self.model_step["spec"]
        # fully_shard's step over each rank alone, which files measured before fsdp's own
        # step was timed alone hold, is no longer read: their fsdp layouts price its copies
        kept = {k: v for k, v in self.model_step.items() if k != "sharded"}
        return MeasuredStep(**{**kept, "spec": StepSpec(
            **{**spec, "input_shape": tuple(spec["input_shape"])}),
            "split": {int(k): v for k, v in self.model_step.get("split", {}).items()},
            "alone": tuple(BackendStep(**found)
                           for found in self.model_step.get("alone", ()))})

    def measured_link(self, source: str) -> Link | None:
        """The link between the nodes as measured, None where one node was."""
        if not self.link:
            return None
        return _link(f"measured across {self.nodes} nodes ({self.backend})", self.link, source)

    def device(self, source: str) -> Device:
        """The cost model's device from these figures; ``source`` names the file."""
        within = _link(f"calibrated {self.backend}", self.collectives, source)
        return Device(name=f"calibrated {self.identity['device']}", flops=self.flops,
                      memory_bandwidth=self.memory_bandwidth, memory=self.memory,
                      intra_node=within,
                      op_overhead=self.op_overhead,
                      # gloo's collectives run on the cores that compute (no engine of their
                      # own): docs/benchmarks.md's scaling runs show nothing hidden on them.
                      overlap=0.0 if self.backend == "gloo" else 1.0,
                      collectives=within.collectives, source=source,
                      device_type="cpu" if self.backend == "gloo" else "cuda",
                      matmul_sweep=self.matmul_sweep, update_seconds=self.update_seconds,
                      pipeline_overhead=self.pipeline_overhead, host_link=self.host_link,
                      host_update_seconds=self.host_update_seconds,
                      host_memory=self.host_memory)


def collective_fit(stored: Mapping[str, Any]) -> CollectiveFit:
    """The cost model's fit of one collective as ``ring_fit`` made it (and a file holds it:
    ``rates`` as lists, absent in files measured before)."""
    return CollectiveFit(**{**stored, "rates": tuple(
        (float(x), float(rate)) for x, rate in stored.get("rates", ()))})


def _link(name: str, fits: dict[str, dict[str, Any]], source: str) -> Link:
    """A link of measured collective ``fits``, its ring figures the allreduce's."""
    collectives = {kind: collective_fit(fit) for kind, fit in fits.items()}
    ring = collectives["all_reduce"]
    return Link(name=name, bandwidth=ring.bus_bandwidth, latency=ring.latency, source=source,
                collectives=collectives)


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


def alone() -> None:
    """``align`` where a rank measures with no other: nothing to wait for."""


def _timed(run: Callable[[], Any], repeats: int, sync: Callable[[], None],
           align: Callable[[], None] = alone) -> float:
    """The median of ``repeats`` timings after one warm-up, each begun once ``align`` returns
    (``device_figures``)."""
    run()
    sync()
    times = []
    for _ in range(repeats):
        align()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sweep(world: int, device: torch.device, sync: Callable[[], None],
          group: Any = None) -> dict[str, dict[str, Any]]:
    """Every collective's fit over ``SIZES`` between the ``world`` ranks of ``group`` (default:
    every rank; collective: each of them calls it): in fp32, and the two that reduce (what
    a 16-bit precision or ``--grad-compression`` sends) in ``SWEPT_16`` too, named by
    ``fit_key``."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    points: dict[tuple[str, torch.dtype], list[tuple[float, float]]] = {}
    for size in SIZES:
        for dtype in (torch.float32, *SWEPT_16):
            whole = torch.ones(size // dtype.itemsize, device=device, dtype=dtype)
            part = torch.ones(size // dtype.itemsize // world, device=device, dtype=dtype)
            runs = {"all_reduce": lambda whole=whole: dist.all_reduce(whole, group=group),
                    "reduce_scatter": lambda whole=whole, part=part: scatter(part, whole,
                                                                             group=group)}
            if dtype == torch.float32:
                runs["all_gather"] = lambda whole=whole, part=part: gather(whole, part,
                                                                           group=group)
            for name, run in runs.items():
                seconds = _timed(run, 5, sync)
                points.setdefault((name, dtype), []).append(
                    (ring_factor(name, world) * size, seconds))
    return {fit_key(name, dtype=dtype_name(dtype)): ring_fit(name, found, world)
            for (name, dtype), found in points.items()}


def ring_fit(kind: str, points: list[tuple[float, float]], ranks: int) -> dict[str, Any]:
    """``fit`` of collective ``kind``'s (ring bytes, seconds) points between ``ranks``, its
    intercept (the whole collective's fixed cost) per ring step, as the cost model
    (``mpt.plan.network.collective``) multiplies it by the steps; and the busbw of each point
    its bytes take most of the time of (at least twice the intercept), the intercept taken out
    (``CollectiveFit.rates``), where the line does not follow the points."""
    found: dict[str, Any] = fit(points)
    fixed = found["latency"]
    found["rates"] = [[x, x / (t - fixed)] for x, t in sorted(points) if t >= 2 * fixed]
    found["latency"] /= ring_steps(kind, ranks)
    return found


def horovod_sweep(world: World, address: str, device: torch.device,
                  sync: Callable[[], None]) -> dict[str, dict[str, Any]]:
    """Horovod's own allreduce between every rank of ``world`` over ``SIZES`` and its default
    tensor-fusion buffer (``FUSION_DEFAULT``: what it sends at once of a step's gradients, and
    its ring's speed per byte still grows there, 0.065 GB/s at 32 MiB and 0.085 at 64 MiB
    across 4 nodes at 1 Gbit/s), in fp32 and in fp16 (``--grad-compression fp16``, whose sums
    Horovod's CPU ops run slower per byte), each fitted by ``ring_fit`` and named by
    ``fit_key``: this rank's ``hvd.init()`` joins the others at the rendezvous ``address`` over
    gloo, as under `mpt launch` (in a process of its own: ``horovod_fits``)."""
    from mpt.backends.horovod import FUSION_DEFAULT
    from mpt.launchers.horovod_join import join_env

    os.environ.update(join_env(world, address))
    import horovod.torch as hvd

    hvd.init()
    found = {}
    try:
        for dtype in (torch.float32, torch.float16):
            points = []
            for size in (*SIZES, FUSION_DEFAULT):
                whole = torch.ones(size // dtype.itemsize, device=device, dtype=dtype)
                seconds = _timed(lambda whole=whole: hvd.allreduce(whole, op=hvd.Sum), 5, sync)
                points.append((ring_factor("all_reduce", world.world_size) * size, seconds))
            name = fit_key("all_reduce", "horovod", dtype_name(dtype))
            found[name] = ring_fit("all_reduce", points, world.world_size)
    finally:
        hvd.shutdown()
    return found


def _rank(local_rank: int, world: World) -> tuple[World, torch.device, Callable[[], None]]:
    """This process as a rank of ``world``, as `mpt launch` starts one (one intra-op thread):
    its world, its device (its GPU, where the node's ranks measure GPUs) and what waits for
    that device."""
    world = dataclasses.replace(world, local_rank=local_rank)
    torch.set_num_threads(1)
    cuda = on_cuda(world)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    return world, device, sync


def _horovod_worker(local_rank: int, world: World, address: str, out: str) -> None:
    """One rank of ``horovod_sweep`` in a process of its own; rank 0 writes the fits."""
    world, device, sync = _rank(local_rank, world)
    found = horovod_sweep(world, address, device, sync)
    if world.rank == 0:
        Path(out).write_text(json.dumps(found))


def horovod_fits(world: World, address: str) -> dict[str, dict[str, Any]]:
    """Horovod's own allreduce fits (``horovod_sweep``) from this node's ``world.gpus``
    processes and every other node's (each node calls this once the rest of the calibration
    has ended), in processes of their own: a Horovod that fails (its gloo's timeout on a slow
    link, a rendezvous lost: it may abort its process) or outlasts ``HOROVOD_DEADLINE`` costs
    only these fits, said in one line on stderr, and the plan then prices ``--backend
    horovod`` by torch's allreduce. Node 0 returns the fits, the others an empty dict."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "horovod.json"
        job = mp.start_processes(_horovod_worker, args=(world, address, str(path)),
                                 nprocs=world.gpus, join=False, start_method="spawn")
        deadline = time.monotonic() + HOROVOD_DEADLINE
        try:
            while not job.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"it ran past {HOROVOD_DEADLINE} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException, TimeoutError) as exc:
            for process in job.processes:
                if process.is_alive():
                    process.kill()
            print(f"mpt plan --calibrate: Horovod's allreduce sweep failed on node {world.nr} "
                  f"({_first_line(exc)}); --backend horovod is priced by torch's allreduce "
                  "instead", file=sys.stderr, flush=True)
            return {}
        return json.loads(path.read_text()) if path.exists() else {}


def alone_steps(step: StepSpec, training: int) -> list[dict[str, Any]]:
    """``step``'s model trained by ``mpt.Runtime`` under each backend's ``timed_alone``
    options (``BackendStep``'s fields), by ``training`` processes at once, each a rank in a
    world of its own (no collective crosses between them): one optimizer step of the
    micro-batch, then, where it has an even size, one of the same samples as two accumulated
    micro-batches, each the median of ``STEP_REPEATS`` x 2 steps after ``STEP_WARMUP``, and
    beside each such step, in the same process, the same step of a plain copy of the model
    (``_plain_step``): the backend's own work is the difference of the two, which a slow spell
    of a shared machine moves little. A backend whose step fails costs only its figures, said
    in one line on stderr."""
    import torch.multiprocessing as mp

    from mpt.backends import registered

    found = []
    for name, cls in registered().items():
        for options in cls.timed_alone():
            try:
                timed = [_alone_step(step, name, options, a, training)
                         for a in ((1, 2) if step.micro_batch % 2 == 0 else (1,))]
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
                print(f"mpt plan --calibrate: {step.model}'s step under --backend {name} "
                      f"{options} was not timed ({_first_line(exc)}); its layouts price its "
                      "collectives and copies alone", file=sys.stderr, flush=True)
                continue
            two = timed[1] if len(timed) > 1 else {}
            found.append({"backend": name, "options": dict(options), "step": timed[0]["step"],
                          "accumulated": two.get("step"), "plain": timed[0]["plain"],
                          "plain_accumulated": two.get("plain")})
    return found


def _alone_step(step: StepSpec, backend: str, options: Mapping[str, Any], accumulate: int,
                training: int) -> dict[str, float]:
    """The median step of ``_alone_worker`` by ``training`` processes at once, and of the
    plain step timed beside it."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "step.json"
        mp.spawn(_alone_worker, nprocs=training, join=True,
                 args=(step, backend, dict(options), accumulate, str(path)))
        return json.loads(path.read_text())


def _alone_worker(local_rank: int, step: StepSpec, backend: str, options: dict[str, Any],
                  accumulate: int, out: str) -> None:
    """One rank of ``alone_steps``: the world of this process alone; rank 0 of the node writes
    the medians."""
    import mpt
    from mpt.estimate import load_model

    # this process's GPU as device 0 of its world of one, named before CUDA first looks
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = (visible[local_rank] if len(visible) > local_rank
                                          and visible[local_rank] else str(local_rank))
    with socket.socket() as probe:  # a free port for this world's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(env)
    torch.set_num_threads(1)
    # DeepSpeed calls torch.distributed functions torch deprecates: a timing has no use for it
    warnings.filterwarnings("ignore", category=FutureWarning)
    rt = mpt.Runtime(env=env, backend=backend, backend_options=options,
                     precision=step.precision, accumulate=accumulate, quiet=True,
                     host_memory=None if torch.cuda.is_available() else CPU_HOST_MEMORY)
    try:
        net = load_model(step.model)()
        net, _ = rt.setup(net, _optimizer(step, net.parameters()))
        x = _sample(step, rt.device)

        def one_step() -> None:
            for piece in x.chunk(accumulate):
                with rt.autocast():
                    out = net(piece)
                rt.backward(_summed(out))
                rt.step()

        (forward_backward, update), _ = _plain_step(step, rt.device)

        def plain_step() -> None:
            forward_backward(accumulate)
            update()

        sync = torch.cuda.synchronize if rt.device.type == "cuda" else lambda: None
        found: dict[str, list[float]] = {"step": [], "plain": []}
        for repeat in range(STEP_WARMUP + 2 * STEP_REPEATS):
            # each backend step beside a plain one: a slow spell of the machine slows both
            for name, run in (("step", one_step), ("plain", plain_step)):
                start = time.perf_counter()
                run()
                sync()
                if repeat >= STEP_WARMUP:
                    found[name].append(time.perf_counter() - start)
    finally:
        rt.close()
    if local_rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in found.items()}))


def _cold_flops(shapes: tuple[tuple[int, int], tuple[int, int]], dtype: torch.dtype,
                device: torch.device, sync: Callable[[], None]) -> float:
    """FLOP/s of ``a @ b`` of these shapes, each timing through enough copies of the operands
    that none is in a cache when its turn comes; a matmul slower than ``SLOW`` seconds (fp16
    on most CPUs) is timed once, alone: its time is its own kernel's, not the caches'."""
    (m, k), (_, n) = shapes
    flops = 2 * m * k * n
    first = (torch.randn(m, k, device=device, dtype=dtype),
             torch.randn(k, n, device=device, dtype=dtype))
    start = time.perf_counter()
    first[0] @ first[1]
    sync()
    once = time.perf_counter() - start
    if once > SLOW:
        return flops / once
    size = (m * k + k * n + m * n) * first[0].element_size()
    copies = max(1, min(-(-COLD_BYTES // size), int(SLOW / max(once, 1e-6))))
    pairs = [first, *((torch.randn(m, k, device=device, dtype=dtype),
                       torch.randn(k, n, device=device, dtype=dtype))
                      for _ in range(copies - 1))]

    def run() -> None:
        for a, b in pairs:
            a @ b

    return flops * len(pairs) / _timed(run, 5, sync)


def matmul_figures(device: torch.device, sync: Callable[[], None]
                   ) -> tuple[dict[str, float], dict[str, dict[str, list[list[float]]]]]:
    """The square matmul's FLOP/s by dtype, and the sweep over the smallest dimension."""
    n = 4096 if device.type == "cuda" else 1024
    peaks: dict[str, float] = {}
    sweeps: dict[str, dict[str, list[list[float]]]] = {}
    for dtype in DTYPES:
        name = dtype_name(dtype)
        square = _cold_flops(((n, n), (n, n)), dtype, device, sync)
        rows = [[s, _cold_flops(((s, n), (n, n)), dtype, device, sync)] for s in SMALLEST]
        inner = [[s, _cold_flops(((n, s), (s, n)), dtype, device, sync)] for s in SMALLEST]
        peaks[name] = square
        sweeps[name] = {"rows": [*rows, [n, square]], "inner": [*inner, [n, square]]}
    return peaks, sweeps


def update_figures(device: torch.device, sync: Callable[[], None],
                   align: Callable[[], None] = alone) -> dict[str, float]:
    """Seconds per parameter of each optimizer's torch step over 4 x 2^20 fp32 parameters
    (with their gradients and states, beyond the caches)."""
    found = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        params = [torch.zeros(1 << 20, device=device, requires_grad=True) for _ in range(4)]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        optimizer = getattr(torch.optim, cls)(params, lr=1e-3, **kwargs)
        found[name] = (_timed(optimizer.step, 5, sync, align)
                       / sum(p.numel() for p in params))
    return found


def host_figures(device: torch.device, sync: Callable[[], None],
                 align: Callable[[], None] = alone) -> dict[str, Any]:
    """Beside a GPU, what offloading pays: bytes per second each way between pinned host
    memory and the device (the slower way of a 64 MiB copy, as fully_shard's offload pins
    its shards), and torch's optimizer steps over host tensors (``update_figures``), the
    training ranks at once. Nothing on a CPU, whose memory is the host's."""
    if device.type == "cpu":
        return {}
    host = torch.ones(1 << 24).pin_memory()
    there = torch.empty_like(host, device=device)
    ways = [_timed(lambda: there.copy_(host, non_blocking=True), 5, sync, align),
            _timed(lambda: host.copy_(there, non_blocking=True), 5, sync, align)]
    return {"host_link": host.nbytes / max(ways),
            "host_update_seconds": update_figures(torch.device("cpu"), alone, align)}


def device_figures(device: torch.device, sync: Callable[[], None],
                   align: Callable[[], None] = alone) -> dict[str, Any]:
    """This rank's matmul FLOP/s by dtype and shape, copy bandwidth, op overhead and optimizer
    steps. Every rank that will train on the machine measures at once, so that each shares it
    as while training; the copy, the op and the optimizers' steps each timing begun on all of
    them together (``align``, a barrier of theirs), as the collective that ends each phase of
    a training step starts the next on every rank at once. On a CPU the ranks share the
    memory's bandwidth (here two ranks' 64 MiB copies ran at 19-22 GB/s each, one rank's
    alone at 34-45); timed apart, two ranks' copies overlapped too little to show it (43.5
    GB/s). The matmuls are not aligned: each rank chooses from its own first run how many
    to time (``_cold_flops``), so their counts of timings may differ."""
    flops, sweeps = matmul_figures(device, sync)
    src = torch.ones(1 << 24, device=device)  # 64 MiB: beyond any cache
    dst = torch.empty_like(src)
    copy = _timed(lambda: dst.copy_(src), 5, sync, align)
    one = torch.ones(1, device=device)
    overhead = _timed(lambda: [one.add_(1) for _ in range(200)], 3, sync, align) / 200
    return {"flops": flops, "matmul_sweep": sweeps, "memory_bandwidth": 2 * src.nbytes / copy,
            "op_overhead": overhead, "update_seconds": update_figures(device, sync, align),
            **host_figures(device, sync, align)}


def pipeline_overheads(pair: Any, position: int, device: torch.device,
                       sync: Callable[[], None]) -> dict[str, float]:
    """Seconds each action of each ``--pipeline-schedule`` costs beyond its compute and its
    sends, measured by the two ranks of ``pair`` (``position`` 0 or 1): torch's schedule run
    over chunks of one ``PROBE_WIDTH`` Linear and ``PROBE_MICROBATCHES`` micro-batches of one
    row, less the wait the schedule's simulation gives for sends of the one-way latency the
    same ranks measured (half a send and receive there and back), over the busiest rank's
    actions: the stage's bookkeeping, the send and receive calls, the autograd calls of each
    forward and backward."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from mpt.pipeline.config import LOOPED, SCHEDULES, schedule_class
    from mpt.plan.schedule import ChunkCost, order, simulate

    ranks = dist.get_process_group_ranks(pair)
    other = ranks[1 - position]
    x = torch.zeros(PROBE_MICROBATCHES, PROBE_WIDTH, device=device)
    row = x[:1].clone()

    def ping() -> None:
        for send in (position == 0, position == 1):
            (dist.send if send else dist.recv)(row, other, group=pair)

    latency = _timed(ping, 10, sync) / 2
    found = {}
    for schedule in SCHEDULES:
        chunks = 2 * LOOPED.get(schedule, 1)
        stages = [PipelineStage(nn.Linear(PROBE_WIDTH, PROBE_WIDTH).to(device), stage_index=i,
                                num_stages=chunks, device=device, group=pair)
                  for i in range(position, chunks, 2)]
        kind = schedule_class(schedule)
        run = kind(stages if len(stages) > 1 else stages[0], n_microbatches=PROBE_MICROBATCHES,
                   loss_fn=lambda out, target: out.sum(), scale_grads=False)
        seconds = _timed(lambda run=run: run.step(x) if position == 0 else run.step(target=x),
                         5, sync)
        waits = simulate(schedule, 2, PROBE_MICROBATCHES, [ChunkCost(
            forward=0.0, backward=0.0, weight=0.0, activations=0, send=latency)] * chunks)
        actions = max(len(mine) for mine in order(schedule, 2, PROBE_MICROBATCHES))
        found[schedule] = max(0.0, (seconds - waits.step) / actions)
    return found


def _sample(spec: StepSpec, device: torch.device) -> torch.Tensor:
    """One micro-batch of ``spec``'s input on ``device``: random floats, or token 0 (valid for
    any vocabulary)."""
    shape = (spec.micro_batch, *spec.input_shape)
    dtype = getattr(torch, spec.input_dtype)
    return (torch.randn(shape, device=device) if dtype.is_floating_point
            else torch.zeros(shape, device=device, dtype=dtype))


def _optimizer(spec: StepSpec, parameters: Any) -> torch.optim.Optimizer:
    """``spec``'s optimizer over ``parameters``, at a tiny rate: the weights stay where they
    began, so no step slows on overflowing values."""
    cls, kwargs = OPTIMIZERS[spec.optimizer]
    return getattr(torch.optim, cls)(parameters, lr=1e-9, **kwargs)


def _summed(out: Any) -> torch.Tensor:
    """A loss of any model's output: the sum of its floating-point tensors."""
    from torch.utils._pytree import tree_leaves

    return sum(t.float().sum() for t in tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _plain_step(spec: StepSpec, device: torch.device) -> tuple[Parts, int]:
    """``spec``'s model, its input and optimizer on ``device``, trained as mpt trains it in
    its precision without a backend: its two timed parts (``Parts``), and its parameters."""
    from mpt.estimate import load_model
    from mpt.precision import make_precision

    # as mpt trains in it: a cast model (O2, O3) cast by the precision itself, batch norm
    # kept where it keeps it and float inputs cast by its hook, else the forward under its
    # autocast
    precision = make_precision(spec.precision, device.type)
    with torch.device(device):
        net = precision.convert_module(load_model(spec.model)())
    x = _sample(spec, device)
    optimizer = _optimizer(spec, net.parameters())

    def forward_backward(pieces: int) -> None:
        for piece in x.chunk(pieces):
            with precision.autocast():
                out = net(piece)
            _summed(out).backward()

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return (forward_backward, update), sum(p.numel() for p in net.parameters())


class ModelStep:
    """``spec``'s model built on ``device`` and trained on one micro-batch: its forward and
    backward, whole and cut into each of ``SPLITS`` pieces that divides it (accumulating), and
    its optimizer step with ``zero_grad`` (gradients to None, as torch's default frees them).
    Timed in spells (``time``) that the calibration spreads over its run, so that a slow spell
    of a shared machine moves the medians (``figures``: ``MeasuredStep``'s fields) by one
    spell's share, not wholly; each timed part begun once ``align`` returns, on every
    rank that trains at once (``device_figures``). A piece count whose pieces the model refuses
    (batch norm's one sample) is not timed; an error of the whole micro-batch (out of memory,
    an input the model refuses) ends the timing and is kept as the figures' ``error``."""

    def __init__(self, spec: StepSpec, device: torch.device, sync: Callable[[], None],
                 align: Callable[[], None] = alone) -> None:
        self.spec, self.sync, self.align = spec, sync, align
        self.splits = [1, *(k for k in SPLITS if spec.micro_batch % k == 0)]
        self.timings: dict[int, list[float]] = {k: [] for k in self.splits}
        self.updates: list[float] = []
        self.error = ""
        self.parameters = 0
        self.plain: Parts | None = None
        try:
            self.plain, self.parameters = _plain_step(spec, device)
            self.splits = [k for k in self.splits if self._accepts(k)]
        except MODEL_ERRORS as exc:
            self.error = _first_line(exc)
            return
        try:
            self._run(STEP_WARMUP, keep=False)
        except MODEL_ERRORS as exc:
            self.error = _first_line(exc)

    def _accepts(self, pieces: int) -> bool:
        """Whether the model trains on its micro-batch cut into ``pieces`` (its refusal of the
        whole one is raised)."""
        assert self.plain is not None
        forward_backward, update = self.plain
        try:
            forward_backward(pieces)
        except MODEL_ERRORS:
            if pieces == 1:
                raise
            return False
        finally:
            update()
        return True

    def _part(self, part: Callable[[], None], into: list[float], keep: bool) -> None:
        self.align()
        start = time.perf_counter()
        part()
        self.sync()
        if keep:
            into.append(time.perf_counter() - start)

    def _run(self, steps: int, keep: bool) -> None:
        assert self.plain is not None
        forward_backward, update = self.plain
        for _ in range(steps):
            for pieces in self.splits:
                self._part(functools.partial(forward_backward, pieces), self.timings[pieces],
                            keep)
                self._part(update, self.updates if pieces == 1 else [], keep)

    def time(self, steps: int = STEP_REPEATS) -> None:
        """One spell: ``steps`` more steps timed (none once an error was kept)."""
        if self.error:
            return
        try:
            self._run(steps, keep=True)
        except MODEL_ERRORS as exc:
            self.error = _first_line(exc)

    def figures(self) -> dict[str, Any]:
        """The medians of every spell's timings, or the error."""
        if self.error:
            return {"error": self.error}
        return {"spec": dataclasses.asdict(self.spec), "parameters": self.parameters,
                "forward_backward": statistics.median(self.timings[1]),
                "update": statistics.median(self.updates),
                "split": {str(k): statistics.median(self.timings[k]) for k in self.splits[1:]}}


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _worker(local_rank: int, world: World, out: str, step: StepSpec | None,
            training: int) -> None:
    import torch.distributed as dist

    world, device, sync = _rank(local_rank, world)
    cuda = device.type == "cuda"
    if not cuda:
        apply_host_memory(CPU_HOST_MEMORY)  # as the plan's launch line on a CPU host runs it
    dist.init_process_group("nccl" if cuda else "gloo",
                            init_method=f"tcp://{world.master_addr}:{world.master_port}",
                            rank=world.rank, world_size=world.world_size,
                            timeout=datetime.timedelta(seconds=MEET_TIMEOUT))
    try:
        # every rank makes every node's group, in the same order (torch's rule for new_group)
        nodes = [dist.new_group([rank for nr, _, rank in world.all_processes() if nr == node])
                 for node in range(world.nodes)]
        # the ranks that will train measure the device and the model at once, each timing
        # begun on all of them together (``device_figures``)
        align = functools.partial(dist.barrier, group=dist.new_group(
            [rank for _, local, rank in world.all_processes() if local < training]))
        # the model's step is timed in three spells, before, between and after the rest, the
        # training ranks together (barriers): a slow minute of a shared machine is one of them
        model = None
        if step is not None and local_rank < training:
            model = ModelStep(step, device, sync, align)
        dist.barrier()
        if model is not None:
            model.time()
        dist.barrier()
        within = sweep(world.gpus, device, sync, nodes[world.nr]) if world.gpus > 1 else {}
        dist.barrier()
        link = sweep(world.world_size, device, sync) if world.nodes > 1 else {}
        # the first two ranks (one node's, or two nodes' where each has one): a pipeline's
        # actions; every rank makes the group, as torch's new_group needs
        pair = dist.new_group([0, 1])
        overheads = (pipeline_overheads(pair, world.rank, device, sync) if world.rank < 2
                     else {})
        dist.barrier()
        if model is not None:
            model.time()
        dist.barrier()
        # the node's training ranks measure at once; a process started only for the
        # collectives (one node of one rank) waits in the gather below
        figures = device_figures(device, sync, align) if local_rank < training else {}
        dist.barrier()  # each rank's figures take their own time: the step starts together
        if model is not None:
            model.time()
            figures["model_step"] = model.figures()
        hosts: list[Any] = [None] * world.world_size
        dist.all_gather_object(hosts, socket.gethostname())
    finally:
        dist.destroy_process_group()
    if world.rank:
        return
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / training
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else host
    Path(out).write_text(json.dumps({
        "ranks": world.gpus, "nodes": world.nodes, "hosts": sorted(set(hosts)),
        "backend": "nccl" if cuda else "gloo", "collectives": within or link, "link": link,
        "memory": memory, "pipeline_overhead": overheads, **figures,
        **({"host_memory": host} if cuda else {})}))


def measure(ranks: int = 2, step: StepSpec | None = None, training: int | None = None
            ) -> Calibration:
    """Measure this machine with ``ranks`` processes, ``training`` of them (default: all) at
    once for the device figures and ``step``'s model."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    found = measure_nodes(World(gpus=ranks, master_port=port, source="mpt plan --calibrate"),
                          step, training)
    assert found is not None  # one node is node 0
    return found


def on_cuda(world: World) -> bool:
    """Whether this node's ranks measure GPUs (one each), else the CPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= world.gpus


def measure_nodes(world: World, step: StepSpec | None = None, training: int | None = None
                  ) -> Calibration | None:
    """Measure this node's processes of ``world`` with every other node's (each node calls
    this with its ``nr``), ``training`` of each node's (default: all) at once for the device
    figures and ``step``'s model; node 0 returns the figures, the others None."""
    import torch.multiprocessing as mp

    from mpt.backends.horovod_launch import unreachable_gloo
    from mpt.launchers.horovod_join import HorovodRendezvous

    # Horovod's collectives too, where it is installed: its workers meet at a rendezvous that
    # node 0 serves, as under `mpt launch`. Not where its gloo would bind loopback across
    # machines: `mpt launch --backend horovod` refuses that job.
    rendezvous = HorovodRendezvous(address="") if unreachable_gloo(
        world.nodes, str(world.master_addr)) else HorovodRendezvous.serve(world)
    # On a CPU the ranks run under the allocator the plan's launch line gives them there, which
    # is preloaded before a process starts: mp.spawn's processes inherit our environment,
    # which is ours again once they end (a test's process keeps no LD_PRELOAD).
    preload = {} if on_cuda(world) else host_memory_env(CPU_HOST_MEMORY, os.environ)
    try:
        with tempfile.TemporaryDirectory() as folder, mock.patch.dict(os.environ, preload):
            path = Path(folder) / "figures.json"
            mp.spawn(_worker, args=(world, str(path), step, training or world.gpus),
                     nprocs=world.gpus, join=True)
            # its ring over every rank: within the node, or across the nodes
            horovod = horovod_fits(world, rendezvous.address) if rendezvous.address else {}
            if world.nr:
                return None
            figures = json.loads(path.read_text())
            if step is not None and "error" not in figures["model_step"]:  # node 0 timed it
                figures["model_step"]["alone"] = alone_steps(step, training or world.gpus)
            figures["link" if world.nodes > 1 else "collectives"].update(horovod)
            if world.nodes > 1 and world.gpus == 1:  # a node of one rank: the link's figures
                figures["collectives"].update(horovod)
    finally:
        rendezvous.stop()
    failed = figures.get("model_step", {}).get("error")
    if step is not None and failed:
        raise UsageError("MODEL", step.model, f"its step did not run on this device ({failed})",
                         "calibrate without MODEL (the plan then prices its ops alone), or "
                         "pass a smaller --batch")
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
    found_format = data.pop("format", None) if isinstance(data, dict) else None
    if isinstance(found_format, str) and found_format.startswith(FORMAT.rpartition("/")[0]) \
            and found_format != FORMAT:
        raise UsageError("--calibration", path, f"it is a {found_format} file, older than "
                         f"this mpt's {FORMAT} (no matmul shape sweep, no optimizer steps)",
                         f"run `mpt plan --calibrate --output {path}` again")
    if found_format != FORMAT:
        raise UsageError("--calibration", path, f"it is not a {FORMAT} file",
                         "pass a file written by `mpt plan --calibrate --output FILE`")
    # Files of this version measured before the calibration ran under --host-memory steady
    # carry the first write of a block glibc's defaults map anew, which the plan no longer prices.
    data.pop("fresh_bandwidth", None)
    found = Calibration(**data)
    here = identity()
    differ = [key for key in ("host", "cpu", "device") if found.identity.get(key) != here[key]
              and not (key == "host" and here[key] in found.hosts)]
    if differ:
        key = differ[0]
        raise UsageError("--calibration", path, f"it was measured on {key} "
                         f"{found.identity.get(key)!r}, and this is {here[key]!r}",
                         "run `mpt plan --calibrate` on this machine, or use --device for a "
                         "datasheet profile")
    return found
