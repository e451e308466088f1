"""What a backend sends per optimizer step over its data-parallel ranks, and what it may hide
behind (``Backend.step_traffic``), as values the cost model of `mpt plan` prices.

Here, beside ``ParallelPlan``, so that backends declare their traffic without importing the
planner. Each backend's figures come from its code and from docs/benchmarks.md's bytes on the
wire (`make scaling`, 2 nodes: ddp, apex and horovod send 100.9 MB for 100.7 MB of gradients,
the ring's 2(N-1)/N; DeepSpeed's default ZeRO-1 1.5x, fsdp 2x on gloo), and the copies into
and out of the buffers the collectives use from the torch code that makes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mpt.parallel.plan import Axis

Kind = Literal["all_reduce", "all_gather", "reduce_scatter"]
Window = Literal["backward", "step", "none"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective of a step over the ranks of one mesh axis."""

    kind: Kind
    """What it does; its per-rank bytes follow the ring (2(N-1)/N or (N-1)/N x the size)."""
    axis: Axis
    """The mesh axis whose groups run it."""
    size: float
    """Bytes of the whole tensor (a rank's gradients, or the parameters it gathers)."""
    what: str
    """What moves, for people: ``gradients``, ``parameters``, ``gradient shard``."""
    library: str = ""
    """The library whose own collective runs it where that is not torch.distributed's
    (``horovod``): the cost model prices it by that library's calibrated fit, where there is
    one."""
    calls: int = 1
    """The separate calls it is made in (DDP's buckets, fsdp's units, PowerSGD's buckets):
    each pays the ring's latency, and together they carry ``size``."""
    dtype: str = "float32"
    """The elements' dtype on the wire (torch's name: ``bfloat16`` under a 16-bit precision or
    ``--grad-compression``): the cost model prices it by that dtype's calibrated fit where
    there is one (gloo sums 16-bit elements on a CPU slower per byte than fp32 ones), else by
    its bytes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Traffic:
    """A backend's data-parallel collectives for one step, and what they may hide behind."""

    collectives: tuple[Collective, ...]
    """Every collective of one step, in order."""
    window: Window
    """Compute they may overlap: the backward, the whole step, or none."""
    shards_optimizer: bool
    """Whether each rank steps only its 1/dp_shard of the optimizer state."""
    copies: float = 0.0
    """Bytes a rank copies per step in memory around these collectives (into and out of the
    flat buffers they send from and receive into: DDP's buckets, fsdp's all-gather and
    reduce-scatter buffers); each is read once and written once, so the cost model prices
    twice this at the device's memory bandwidth. 0: none modelled."""
    host_copies: float = 0.0
    """Bytes a rank moves between host memory and the device's per step where the backend
    offloads (shards or partitions fetched before they are gathered or stepped, gradients
    sent to the host, updated weights sent back), both ways together: the cost model prices
    them at the device's host link. Where the device's memory is the host's (a CPU rank)
    they are copies in memory where the backend copies into host buffers of its own
    (``host_buffers``), else nothing (torch's ``.to("cpu")`` returns the tensor itself)."""
    host_buffers: bool = False
    """Whether ``host_copies`` go through host buffers of the backend's own (DeepSpeed's fp32
    gradients and its 16-bit staging buffer of the update), which it copies into even where
    the device's memory is the host's."""
    steps_on_host: bool = False
    """Whether the optimizer steps on the host's cores (its state offloaded): priced by the
    host's step, not the device's."""
    flat_step: float | None = None
    """Where the backend flattens the rank's optimizer state into tensors of its own
    (DeepSpeed's partitions), the most elements one of them holds (``math.inf``: one tensor
    of all of it): the optimizer's temporaries are of that tensor at once. None: the
    optimizer steps the model's own tensors."""
    matmuls: tuple[tuple[int, int, int], ...] = ()
    """The backend's own matmuls per step, each as (rows, inner, columns), in the gradients'
    dtype (PowerSGD's products of each gradient matrix and its factors: ``DDPBackend``): the
    cost model prices each as it prices the model's, at the throughput of its shape, in the
    compute."""
