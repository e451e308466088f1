"""What a device computes and what a link carries: named datasheet profiles, or calibrated ones.

A profile is a set of figures the cost model divides by; nothing in it is fitted to the
predictions it is later compared with. The datasheet figures below are the vendors' published
peaks (dense, no sparsity), set before any comparison:

- NVIDIA H100 SXM5 80 GB ("NVIDIA H100 Tensor Core GPU" datasheet, nvidia.com/h100): bf16/fp16
  tensor core 989 TFLOP/s dense, fp32 (no TF32) 67 TFLOP/s, HBM3 3.35 TB/s, NVLink 4 900 GB/s
  per GPU (both directions together: 450 GB/s each way).
- NVIDIA H200 SXM 141 GB (nvidia.com/h200): the H100's compute, HBM3e 4.8 TB/s, NVLink 900 GB/s.
- NVIDIA A100 SXM4 80 GB / 40 GB ("NVIDIA A100 Tensor Core GPU" datasheet, nvidia.com/a100):
  bf16/fp16 312 TFLOP/s dense, fp32 19.5 TFLOP/s, HBM2e 2.04 TB/s (80 GB) / 1.56 TB/s (40 GB),
  NVLink 3 600 GB/s per GPU (300 GB/s each way).
- NVIDIA Tesla P100 PCIe 16 GB ("NVIDIA Tesla P100" datasheet, nvidia.com/p100): fp32 9.3
  TFLOP/s, fp16 18.7 TFLOP/s (no bf16: bf16 takes the fp32 figure), HBM2 732 GB/s; its GPUs
  talk over PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 = 15.75 GB/s each way.
- Ethernet / InfiniBand links by their line rate (1, 10, 100, 200, 400 Gbit/s, each way).
- Host to device (what offloading moves), the datasheets' PCIe figure, both directions
  together, halved: H100 SXM5 and H200 PCIe Gen5 128 GB/s (64 each way), A100 SXM4 PCIe Gen4
  64 GB/s (32), P100 PCIe Gen3 x16 (15.75, as above).
- The host's memory bandwidth per GPU, for an offloaded optimizer step: an assumption, that
  of the NVIDIA DGX built with that GPU (its two CPUs' memory channels x their DDR rate x 8
  bytes, over its 8 GPUs): DGX H100 and H200 (2 x Xeon Platinum 8480C, 8 x DDR5-4800 each)
  76.8 GB/s, DGX A100 (2 x EPYC 7742, 8 x DDR4-3200 each) 51.2 GB/s, DGX-1 with P100
  (2 x Xeon E5-2698 v4, 4 x DDR4-2400 each) 19.2 GB/s; and its host memory over its 8
  GPUs, what a rank may offload into: DGX H100 and H200 2 TB (256 GB a GPU), DGX A100 2 TB
  with the 80 GB GPUs and 1 TB with the 40 GB (256 and 128 GB), DGX-1 512 GB (64 GB).
  Another server's host differs.

A datasheet peak is never reached by a whole training step (kernel launches, memory-bound ops,
the optimizer): the model adds the memory-bound time of every op (a roofline per op) but no
other inefficiency, so a datasheet prediction is a lower bound, and the output says so.
Latencies of datasheet links (5 us per ring step) are an assumption, stated as such.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpt.errors import UsageError

CPU_HOST_MEMORY = "steady"
"""The ``--host-memory`` a CPU host's plan prices: its launch line carries it and its
calibration runs under it. Freed blocks are then kept for reuse (by jemalloc, or glibc's heap
where the machine has no jemalloc), so that after the first steps no step faults memory in
again, as on a GPU. Under glibc's defaults (``fast``) a step can fault in blocks of 32 MiB and
more (mapped anew each time) and a heap's trimmed top, depending on the heap (fsdp's ResNet-18
at one rank: 1.26 x the step; docs/plan.md)."""

GB = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One direction of a connection between two ranks: what a ring step over it costs."""

    name: str
    """The profile's name (``400gbit``, ``nvlink4``, ``calibrated gloo``)."""
    bandwidth: float
    """Bytes per second each way (a collective's bus bandwidth where calibrated)."""
    latency: float = 5e-6
    """Seconds one ring step costs whatever its size."""
    source: str = "datasheet"
    """Where the figures come from: ``datasheet`` or the calibration file."""
    collectives: Mapping[str, CollectiveFit] = field(default_factory=dict)
    """Measured over this link, by collective (``all_reduce``, ``all_gather``,
    ``reduce_scatter``): each one's bus bandwidth and latency, which take the place of
    ``bandwidth`` and ``latency`` for it (a library's collectives differ: gloo's reduce-scatter
    moves an allreduce's bytes); empty: the ring at ``bandwidth``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveFit:
    """A collective measured between the ranks of one machine: t = latency + factor x S / busbw
    with the ring's factor (2(N-1)/N for an allreduce, (N-1)/N for the others)."""

    latency: float
    """Seconds of a collective of no bytes, per ring step."""
    bus_bandwidth: float
    """Bytes per second a rank moves in it, as nccl-tests' busbw: the fitted line's."""
    rates: tuple[tuple[float, float], ...] = ()
    """Calibrated only: ``(ring bytes, busbw)`` at each size the sweep measured, ascending,
    its latency taken out; empty: ``bus_bandwidth`` at every size. A collective whose rate
    changes with its size (gloo's all-gather on a shaped link: 100-104 MB/s of ring bytes
    at 4 MiB, 72-73 at 32 MiB) is priced at each call's size by these."""

    def bandwidth_at(self, size: float) -> float:
        """The busbw of one call sending ``size`` ring bytes: read between the measured sizes
        (linear in log size), the nearest one's beyond them, the line's where none were."""
        return interpolate(self.rates, size) if self.rates else self.bus_bandwidth


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSpec:
    """A model whose own training step a calibration times beside the device figures."""

    model: str
    """``FILE.py:FUNCTION`` or ``package.module:FUNCTION`` (`mpt plan`'s MODEL)."""
    input_shape: tuple[int, ...]
    """One sample's shape."""
    input_dtype: str
    """``float32``, or ``int64`` for token ids (timed as token 0, valid for any vocabulary)."""
    micro_batch: int
    """Samples per forward on each rank."""
    precision: str
    """``--precision``: autocast, or the model cast, as the plan prices it."""
    optimizer: str
    """``--optimizer`` (``mpt.plan.calibrate.OPTIMIZERS``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendStep:
    """The model's training step under one backend, at one rank in a world of its own
    (``Backend.timed_alone``): ``mpt.Runtime``'s forward, backward and step, timed by a
    calibration on its device (the node's training ranks at once, each alone)."""

    backend: str
    """``--backend``."""
    options: Mapping[str, Any]
    """Its options (``--zero-stage 3``: ``{"zero_stage": 3}``)."""
    step: float
    """Seconds of one optimizer step of ``StepSpec.micro_batch`` samples (the median)."""
    accumulated: float | None = None
    """Seconds of one optimizer step of the same samples as two accumulated micro-batches
    (the median); None where the micro-batch has an odd size."""
    plain: float | None = None
    """Seconds of the same step of a plain copy of the model, timed beside ``step`` in the
    same process (the median); None in files measured before it was."""
    plain_accumulated: float | None = None
    """The same beside ``accumulated``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredStep:
    """One model's own training step, timed by a calibration on its device (by a node's
    training ranks at once): what the plan scales its op-by-op compute and its optimizer step
    by."""

    spec: StepSpec
    """What was timed."""
    parameters: int
    """The model's parameters: with the input, what a plan matches it to its model by."""
    forward_backward: float
    """Seconds of one forward and backward (the median)."""
    update: float
    """Seconds of one optimizer step and ``zero_grad`` (the median)."""
    split: Mapping[int, float] = field(default_factory=dict)
    """Seconds of the forward and backward of the same samples cut into k micro-batches that
    accumulate, by k (the median; empty in files measured before it was)."""
    alone: tuple[BackendStep, ...] = ()
    """The model's step under each backend and options that time it
    (``Backend.timed_alone``), at one rank in a world of its own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """What one rank's device does per second."""

    name: str
    """The profile's name (``h100-sxm``) or the calibrated device's."""
    flops: Mapping[str, float]
    """Matmul FLOP/s by dtype name (``float32``, ``bfloat16``, ``float16``)."""
    memory_bandwidth: float
    """Bytes per second an elementwise op streams through memory."""
    memory: float
    """Bytes of device memory one rank may fill."""
    intra_node: Link
    """The link between two ranks of one node."""
    op_overhead: float = 0.0
    """Seconds each op costs beyond its FLOPs and bytes (dispatch, kernel launch)."""
    overlap: float = 1.0
    """Fraction of its overlap window a backend's collectives really hide behind compute:
    1 where the collectives run on engines of their own (NCCL), 0 where they take the cores the
    compute runs on (gloo on a CPU: docs/benchmarks.md's scaling runs measure negative overlap)."""
    collectives: Mapping[str, CollectiveFit] = field(default_factory=dict)
    """Measured collectives between ranks of one node, by name (``all_reduce``,
    ``all_gather``, ``reduce_scatter``); empty: the intra-node link's ring figures."""
    source: str = "datasheet"
    """``datasheet``, or the calibration file the figures were measured into."""
    device_type: str = "cuda"
    """torch's device type of the ranks (what precision refusals are checked for)."""
    matmul_sweep: Mapping[str, Mapping[str, Sequence[Sequence[float]]]] = field(
        default_factory=dict)
    """Calibrated only: by dtype name, then ``rows`` (few output rows or columns: a forward,
    an input gradient) or ``inner`` (a short inner dimension: a weight gradient), the FLOP/s
    measured at each smallest dimension, ``[[dim, flops], ...]`` ascending; empty for a
    datasheet profile, whose matmuls run at the peak."""
    update_seconds: Mapping[str, float] = field(default_factory=dict)
    """Calibrated only: seconds torch's optimizer step takes per parameter, by ``--optimizer``
    name; empty: the step streams its bytes at the memory bandwidth."""
    pipeline_overhead: Mapping[str, float] = field(default_factory=dict)
    """Calibrated only: seconds each action (a forward, a backward, or zero bubble's input or
    weight gradients) of a pipeline schedule costs beyond its compute and its sends, by
    ``--pipeline-schedule``; empty: none counted."""
    host_link: float | None = None
    """Bytes per second each way between host memory and the device's (what offloading
    moves); None where the device's memory is the host's (a CPU rank): offloading then moves
    nothing, and what it offloads stays in the rank's memory."""
    host_update_seconds: Mapping[str, float] = field(default_factory=dict)
    """Calibrated only: seconds per parameter of torch's optimizer step over host tensors
    (the step an offloaded optimizer runs), by ``--optimizer``; empty: its bytes at
    ``host_bandwidth``."""
    host_bandwidth: float = 0.0
    """Bytes per second the host's memory streams for one rank (an offloaded optimizer step
    where none was calibrated)."""
    host_memory: float = 0.0
    """Bytes of host memory one rank may fill with what it offloads, beside a device with
    memory of its own (0: not known; nothing offloaded fits)."""

    @property
    def shares_host_memory(self) -> bool:
        """Whether the device's memory is the host's (no ``host_link``: a CPU rank)."""
        return self.host_link is None

    def matmul_flops(self, dtype: str, shape: Sequence[int] | None = None) -> float:
        """FLOP/s of a matmul in ``dtype`` (the fp32 figure where the dtype was not measured)
        of ``shape`` (rows, inner, columns): interpolated in the calibrated sweep by its
        smallest dimension, the peak where there is no sweep, no shape or a large dimension."""
        peak = self.flops.get(dtype, self.flops["float32"])
        sweep = self.matmul_sweep.get(dtype, self.matmul_sweep.get("float32"))
        if not sweep or shape is None:
            return peak
        rows, inner, columns = shape
        kind = "inner" if inner < min(rows, columns) else "rows"
        return interpolate(sweep[kind], min(shape)) if sweep.get(kind) else peak


def interpolate(points: Sequence[Sequence[float]], x: float) -> float:
    """``points`` (ascending ``[x, y]``) read at ``x``: linear in log x between two points,
    the end point's value beyond either end."""
    xs = [float(p[0]) for p in points]
    at = bisect.bisect_left(xs, x)
    if at == 0:
        return float(points[0][1])
    if at == len(xs):
        return float(points[-1][1])
    (x0, y0), (x1, y1) = points[at - 1], points[at]
    share = math.log(x / x0) / math.log(x1 / x0)
    return float(y0 + share * (y1 - y0))


def _gpu(name: str, bf16: float, fp32: float, hbm: float, memory_gb: float, nvlink: str,
         pcie: float, host: float, host_gb: float) -> Device:
    return Device(name=name, flops={"bfloat16": bf16 * 1e12, "float16": bf16 * 1e12,
                                    "float32": fp32 * 1e12},
                  memory_bandwidth=hbm * 1e12, memory=memory_gb * GB, intra_node=LINKS[nvlink],
                  op_overhead=0.0, overlap=1.0, host_link=pcie * GB, host_bandwidth=host * GB,
                  host_memory=host_gb * GB)


LINKS: dict[str, Link] = {
    "nvlink4": Link(name="nvlink4", bandwidth=450 * GB),  # 900 GB/s both ways together
    "nvlink3": Link(name="nvlink3", bandwidth=300 * GB),  # 600 GB/s both ways together
    "pcie3": Link(name="pcie3", bandwidth=15.75 * GB),  # x16, each way
    **{f"{rate}gbit": Link(name=f"{rate}gbit", bandwidth=rate * 1e9 / 8)
       for rate in (1, 10, 25, 100, 200, 400)},
}
"""Named links; any ``<N>gbit`` or ``<N>mbit`` rate is also taken as a line rate."""

DEVICES: dict[str, Device] = {
    "h100-sxm": _gpu("h100-sxm", 989.0, 67.0, 3.35, 80, "nvlink4", 64.0, 76.8, 256),
    "h200": _gpu("h200", 989.0, 67.0, 4.8, 141, "nvlink4", 64.0, 76.8, 256),
    "a100-sxm-80gb": _gpu("a100-sxm-80gb", 312.0, 19.5, 2.039, 80, "nvlink3", 32.0, 51.2, 256),
    "a100-sxm-40gb": _gpu("a100-sxm-40gb", 312.0, 19.5, 1.555, 40, "nvlink3", 32.0, 51.2, 128),
    "p100-pcie": Device(name="p100-pcie", flops={"float16": 18.7e12, "float32": 9.3e12},
                        memory_bandwidth=0.732e12, memory=16 * GB, intra_node=LINKS["pcie3"],
                        host_link=LINKS["pcie3"].bandwidth, host_bandwidth=19.2 * GB,
                        host_memory=64 * GB),
}
"""Named devices with their datasheet figures (sources in the module docstring)."""

RATE = re.compile(r"(\d+(?:\.\d+)?)(g|m)bit")


def device_profile(name: str) -> Device:
    """The named device; a UsageError lists the known ones."""
    if name not in DEVICES:
        raise UsageError("--device", name, "no such device profile",
                         f"use one of {', '.join(DEVICES)}, or --calibration FILE from "
                         "`mpt plan --calibrate`")
    return DEVICES[name]


def link_profile(name: str) -> Link:
    """The named link, or a line rate such as ``25gbit``; a UsageError lists the known."""
    if name in LINKS:
        return LINKS[name]
    rate = RATE.fullmatch(name.strip().lower())
    if rate is None or float(rate.group(1)) <= 0:
        raise UsageError("--link", name, "no such link profile",
                         f"use one of {', '.join(LINKS)}, or a rate such as 25gbit or 500mbit")
    scale = 1e9 if rate.group(2) == "g" else 1e6
    return Link(name=name, bandwidth=float(rate.group(1)) * scale / 8)
