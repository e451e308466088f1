"""How long a collective over the ranks of one mesh axis takes on a cluster, and what it puts
on each node's link.

Ranks are numbered node by node (``rank = node x gpus + local rank``), and a ring visits a
group's ranks in rank order, so each group leaves a node over one ring edge: a node's link
carries the per-rank bytes of every group that spans nodes and has ranks on it, all at once.
A collective then takes its ring steps' latency plus the longer of its intra-node edge (the
device's link, or the collective measured between its ranks where calibrated) and the node's
link shared by those groups (its rate, or the collective measured across nodes where the link
carries such a fit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mpt.parallel import Axis, ParallelPlan
from mpt.plan.profiles import CollectiveFit, Device, Link


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """The machines a plan is for."""

    nodes: int
    """Nodes of the job."""
    gpus: int
    """Ranks (devices) per node."""
    device: Device
    """What each rank computes with, and the link between ranks of a node."""
    link: Link
    """Each node's link to the others (one direction)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """A collective's cost on the cluster."""

    seconds: float
    """Wall time of the collective."""
    per_rank: float
    """Bytes each rank sends."""
    link_bytes: float
    """Bytes the busiest node's link carries (0 when the groups stay inside nodes)."""
    crosses: bool
    """Whether its groups span nodes."""


def ring_factor(kind: str, ranks: int) -> float:
    """Bytes each rank sends, over the tensor's: 2(N-1)/N for an allreduce, (N-1)/N for an
    all-gather or reduce-scatter (a send is one rank's share)."""
    share = (ranks - 1) / ranks
    return 2 * share if kind == "all_reduce" else share


def ring_steps(kind: str, ranks: int) -> int:
    """Sends one rank makes in a ring collective: 2(N-1) for an allreduce, N-1 otherwise."""
    return 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1


def fit_key(kind: str, library: str = "", dtype: str = "float32") -> str:
    """The name a calibration gives the fit of collective ``kind`` run by ``library`` (""
    for torch.distributed) on ``dtype`` elements: ``all_reduce``, ``horovod:all_reduce``,
    ``reduce_scatter/bfloat16``."""
    return (f"{library}:" if library else "") + kind + (
        "" if dtype == "float32" else f"/{dtype}")


def fit_of(fits: Mapping[str, CollectiveFit], kind: str, library: str = "",
           dtype: str = "float32") -> CollectiveFit | None:
    """The most specific fit calibrated of ``kind``: run by ``library`` on ``dtype`` elements,
    else by ``library`` on fp32 ones (priced by bytes), else torch's likewise."""
    for key in (fit_key(kind, library, dtype), fit_key(kind, library), fit_key(kind, "", dtype),
                kind):
        if key in fits:
            return fits[key]
    return None


def collective(kind: str, size: float, plan: ParallelPlan, axis: Axis, cluster: Cluster,
               library: str = "", dtype: str = "float32", calls: int = 1) -> Transfer:
    """A collective of a ``size``-byte tensor of ``dtype`` elements over every group of
    ``axis`` at once, in ``calls`` calls (each pays the ring's latency), run by ``library``'s
    own collective where one was calibrated (else torch.distributed's), priced by the fit
    ``fit_of`` finds."""
    groups = plan.groups(axis)
    ranks = len(groups[0])
    if ranks == 1 or size <= 0:
        return Transfer(seconds=0.0, per_rank=0.0, link_bytes=0.0, crosses=False)
    per_rank = ring_factor(kind, ranks) * size
    steps = ring_steps(kind, ranks)
    fit = fit_of(cluster.device.collectives, kind, library, dtype)
    latency = fit.latency if fit else cluster.device.intra_node.latency
    call = per_rank / calls  # each call's ring bytes, at which its rate was measured
    intra_bandwidth = fit.bandwidth_at(call) if fit else cluster.device.intra_node.bandwidth
    nodes_of = [{rank // cluster.gpus for rank in group} for group in groups]
    crossing = [nodes for nodes in nodes_of if len(nodes) > 1]
    inside = any(len(group) > len(nodes) for group, nodes in zip(groups, nodes_of, strict=True))
    intra = per_rank / intra_bandwidth if inside else 0.0
    link_bytes, link_bandwidth = 0.0, cluster.link.bandwidth
    if crossing:
        busiest = max(sum(node in nodes for nodes in crossing) for node in range(cluster.nodes))
        link_bytes = busiest * per_rank
        between = fit_of(cluster.link.collectives, kind, library, dtype)  # across nodes
        latency = max(latency, between.latency if between else cluster.link.latency)
        link_bandwidth = between.bandwidth_at(call) if between else link_bandwidth
    seconds = calls * steps * latency + max(intra, link_bytes / link_bandwidth)
    return Transfer(seconds=seconds, per_rank=per_rank, link_bytes=link_bytes,
                    crosses=bool(crossing))


def send(size: float, plan: ParallelPlan, cluster: Cluster) -> Transfer:
    """One point-to-point send of ``size`` bytes between adjacent pipeline stages (every
    replica's at once)."""
    if plan.pp == 1 or size <= 0:
        return Transfer(seconds=0.0, per_rank=0.0, link_bytes=0.0, crosses=False)
    pairs = [(plan.rank_at(pp=s, dp_replicate=r, dp_shard=d, tp=t),
              plan.rank_at(pp=s + 1, dp_replicate=r, dp_shard=d, tp=t))
             for s in range(plan.pp - 1) for r in range(plan.dp_replicate)
             for d in range(plan.dp_shard) for t in range(plan.tp)]
    crossing = [(a // cluster.gpus, b // cluster.gpus) for a, b in pairs
                if a // cluster.gpus != b // cluster.gpus]
    if not crossing:
        link = cluster.device.intra_node
        return Transfer(seconds=link.latency + size / link.bandwidth, per_rank=size,
                        link_bytes=0.0, crosses=False)
    busiest = max(sum(node == a for a, _ in crossing) for node in range(cluster.nodes))
    return Transfer(seconds=cluster.link.latency + busiest * size / cluster.link.bandwidth,
                    per_rank=size, link_bytes=busiest * size, crosses=True)
