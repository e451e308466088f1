"""The world of one process: how many nodes, how many processes per node, and who this one is."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mpt.errors import UsageError


def device_name(local_rank: int, cuda: bool) -> str:
    """The device of the process with ``local_rank``: its own GPU, or the CPU without CUDA."""
    return f"cuda:{local_rank}" if cuda else "cpu"


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    """Rank arithmetic of a job, in one validated place.

    The job has ``nodes`` nodes with ``gpus`` processes each (one process per GPU, or per CPU
    worker on a machine without CUDA). Global ranks are assigned node by node::

        world_size = nodes * gpus
        rank       = nr * gpus + local_rank

    This is the assignment torchrun, SLURM's block distribution and horovodrun all use; a
    launcher that numbers ranks differently is reported as an error by the detector that reads it.
    """

    nodes: int = 1
    """Number of nodes (machines) in the job."""
    gpus: int = 1
    """Processes per node: one per GPU, or CPU worker processes where there is no GPU."""
    nr: int = 0
    """Rank of this node, 0 <= nr < nodes. Node 0 hosts the rendezvous."""
    local_rank: int = 0
    """Rank of this process on its node, 0 <= local_rank < gpus; selects the GPU."""
    master_addr: str | None = "127.0.0.1"
    """Address of node 0, where the process group rendezvous; None when the launcher did not say."""
    master_port: int = 29500
    """TCP port of the rendezvous on node 0."""
    source: str = "local"
    """Which launcher or cluster environment this world was read from."""
    attempt: int = 0
    """How often the launcher restarted the gang before this start, where every start meets in
    the launcher's one store (`mpt launch`): the process group keeps each attempt's keys apart."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name}", value, "it must be a whole number of at least 1",
                                 f"pass --{name} 1 or more")
        if not isinstance(self.nr, int) or not 0 <= self.nr < self.nodes:
            raise UsageError("--nr", self.nr, f"the node rank must be in 0..{self.nodes - 1} for "
                             f"--nodes {self.nodes}", f"pass --nr between 0 and {self.nodes - 1}")
        if not isinstance(self.local_rank, int) or not 0 <= self.local_rank < self.gpus:
            raise UsageError("local_rank", self.local_rank, f"it must be in 0..{self.gpus - 1} "
                             f"for {self.gpus} processes per node",
                             "start the process through `mpt launch` or a supported launcher")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise UsageError("--master-port", self.master_port, "a TCP port is 1..65535",
                             "pass a free port such as 29500")

    @property
    def world_size(self) -> int:
        """Total number of processes in the job."""
        return self.nodes * self.gpus

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.nr * self.gpus + self.local_rank

    @property
    def is_distributed(self) -> bool:
        """True when there is more than one process, i.e. a process group is needed."""
        return self.world_size > 1

    def all_processes(self) -> Iterator[tuple[int, int, int]]:
        """Every process of the job as ``(nr, local_rank, rank)``, in rank order."""
        for nr in range(self.nodes):
            for local_rank in range(self.gpus):
                yield nr, local_rank, nr * self.gpus + local_rank
