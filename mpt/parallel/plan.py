"""The job's parallel layout: named mesh axes whose sizes multiply to the world.

One object holds every degree, checks it against the world (and every world an elastic job may
reach), places each rank on the mesh and builds the ``DeviceMesh``. The launcher's checks,
``--dry-run``, ``mpt estimate-memory``, the batch plan and the data loader's shard all read it;
no other module repeats the arithmetic.

Rank ``r``'s coordinates are ``r`` written in the mixed radix of ``AXES``, ``tp`` fastest: a
tensor-parallel group is consecutive ranks (one node's GPUs, where links are fastest), then the
ranks that split the state (``dp_shard``), then whole replicas, and the pipeline stage varies
slowest, so that with one stage per node only activations cross nodes. This is torchtitan's
order; with ``pp`` and one data axis it is also the order mpt's pipeline always used (rank r is
stage r // D of replica r % D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mpt.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Axis = Literal["pp", "dp_replicate", "dp_shard", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's axes, slowest-varying first."""
FLAGS: dict[Axis, str] = {"pp": "--pipeline-stages", "dp_replicate": "--gpus",
                          "dp_shard": "--gpus", "tp": "--tensor-parallel"}
"""The `mpt launch` flag that sets each axis (the data axes take the ranks the others leave)."""



def divisors(n: int) -> list[int]:
    """Every size that splits ``n`` ranks (or units) evenly, ascending: what a refusal offers."""
    return [d for d in range(1, n + 1) if n % d == 0]

@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan:
    """How the ranks of one job split the work; every size is 1 where the axis is unused."""

    pp: int = 1
    """Pipeline stages one model replica spans."""
    dp_replicate: int = 1
    """Data-parallel ranks that each hold a whole copy of what ``dp_shard`` splits (DDP's
    replicas; HSDP's outer dimension)."""
    dp_shard: int = 1
    """Data-parallel ranks that split parameters, gradients and optimizer state among them
    (fsdp, ZeRO)."""
    tp: int = 1
    """Ranks each layer's weights and matmuls are split over (tensor parallelism)."""

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise UsageError(FLAGS[axis], size, f"the {axis} axis needs at least one rank",
                                 f"pass {FLAGS[axis]} 1 or more")

    @classmethod
    def for_world(cls, world_size: int, *, pp: int = 1, tp: int = 1,
                  data_axis: Axis = "dp_replicate") -> ParallelPlan:
        """The layout of a world of ``world_size`` processes: the data axis ``data_axis`` (the
        backend's: ``dp_shard`` where it splits the state) takes the ranks that ``pp`` and
        ``tp`` leave. A UsageError names the flag when they do not divide the world."""
        model = pp * tp  # the ranks one replica spans
        if world_size % model:
            flag, size, rest = (("--pipeline-stages", pp, tp) if world_size % pp or tp == 1
                                else ("--tensor-parallel", tp, pp))
            fits = [d for d in range(1, world_size + 1) if world_size % (d * rest) == 0]
            raise UsageError(flag, size, f"{pp} pipeline stage(s) x {tp} tensor-parallel "
                             f"rank(s) do not divide the world of {world_size} processes into "
                             "whole model replicas", f"pass {flag} one of "
                             f"{', '.join(map(str, fits))}, or change --gpus/--nodes")
        data = world_size // model
        if data_axis == "dp_shard":
            return cls(pp=pp, dp_shard=data, tp=tp)
        return cls(pp=pp, dp_replicate=data, tp=tp)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The size of each axis of ``AXES``, in order."""
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def data_dims(self) -> tuple[Axis, ...]:
        """The mesh dimensions a data-parallel backend spans: both data axes under HSDP (a 2-D
        mesh that fully_shard replicates over its first and shards over its second), else the
        one in use."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return ("dp_replicate", "dp_shard")
        return ("dp_replicate",) if self.dp_replicate > 1 else ("dp_shard",)

    @property
    def model_size(self) -> int:
        """Ranks one model replica spans: its pipeline stages times its tensor-parallel ranks."""
        return self.pp * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that read distinct data: the replicas times the ranks that shard them."""
        return self.dp_replicate * self.dp_shard

    # -- where a rank sits ------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[Axis, int]:
        """Rank ``rank``'s coordinate on every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        coords: dict[Axis, int] = {}
        for axis, size in zip(reversed(AXES), reversed(self.sizes), strict=True):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in AXES}

    def rank_at(self, **coords: int) -> int:
        """The rank at ``coords`` (0 on the axes not named)."""
        rank = 0
        for axis, size in zip(AXES, self.sizes, strict=True):
            rank = rank * size + coords.get(axis, 0)
        return rank

    def dp_rank(self, rank: int) -> int:
        """Which shard of the data ``rank`` reads: its place among the ``dp_size`` readers."""
        at = self.coords(rank)
        return at["dp_replicate"] * self.dp_shard + at["dp_shard"]

    def stage(self, rank: int) -> int:
        """``rank``'s pipeline stage."""
        return self.coords(rank)["pp"]

    def groups(self, axis: Axis) -> list[list[int]]:
        """The ranks of every group along ``axis`` (those that differ only on it), each in
        order of the axis: what ``DeviceMesh`` makes a process group of."""
        found: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            at = self.coords(rank)
            key = tuple(v for a, v in at.items() if a != axis)
            found.setdefault(key, []).append(rank)
        return list(found.values())

    # -- for people and for torch -----------------------------------------------------------------
    def describe(self) -> str:
        """One line: each axis in use with its size, e.g. ``2 pipeline stages x 2 data-parallel
        replicas``."""
        words = {"pp": "pipeline stage(s)", "dp_replicate": "data-parallel replica(s)",
                 "dp_shard": "rank(s) sharding the state", "tp": "tensor-parallel rank(s)"}
        parts = [f"{getattr(self, axis)} {words[axis]}" for axis in AXES
                 if getattr(self, axis) > 1]
        return " x ".join(parts) or "1 process"

    def mesh(self, device_type: str) -> DeviceMesh:
        """The job's ``DeviceMesh`` with one named dimension per axis (size-1 ones included, so
        that ``mesh["pp"]`` exists in every layout); collective: every rank calls it."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.sizes, mesh_dim_names=AXES)

    def data_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh of the data axes alone (``data_dims``), for a layout without model axes:
        only its own process groups are made. Collective."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.model_size > 1:
            return self.mesh(device_type)[self.data_dims]
        dims = self.data_dims
        return init_device_mesh(device_type, tuple(getattr(self, d) for d in dims),
                                mesh_dim_names=dims)


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Where one rank sits in the job's ``ParallelPlan``, as data loading, batch planning,
    learning-rate scaling and throughput need it (``rt.topology``)."""

    plan: ParallelPlan
    """The job's layout."""
    rank: int
    """This rank's global rank."""
    computes_loss: bool = True
    """Whether this rank's step produces the loss (a pipeline's last stage; else every rank)."""

    @property
    def dp_rank(self) -> int:
        """Which shard of the data this rank reads."""
        return self.plan.dp_rank(self.rank)

    @property
    def model_size(self) -> int:
        """Ranks one model replica spans: its pipeline stages times its tensor-parallel ranks."""
        return self.plan.model_size

    @property
    def dp_size(self) -> int:
        """Ranks that read distinct data and average gradients."""
        return self.plan.dp_size

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.plan.stage(self.rank)

    @property
    def stages(self) -> int:
        """Pipeline stages one model replica spans (1: the whole model on every rank)."""
        return self.plan.pp
