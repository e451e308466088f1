"""Each node of a multi-node job claims its ``--nr`` at node 0 before its processes start.

torch's static rendezvous trusts every node's rank: two nodes given the same ``--nr`` both
write that rank's slot, the slot of the rank nobody gave stays empty, and every node waits for it
until ``--rdzv-timeout``, then reports a timeout that names no culprit. So each `mpt launch`
first adds 1 to the key of its node rank in node 0's rendezvous store; the node that gets 2 is
the second to claim it and stops at once, naming the flag, the value and the fix. The other
nodes, one node short, end within ``--rdzv-timeout``.

Node 0's `mpt launch` hosts the store before torch's agent starts: the agent's own store, built
with ``multi_tenant=True`` on the same port in the same process, then shares that server.
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType

from torch.distributed import DistError, TCPStore

from mpt.errors import MptError, UsageError
from mpt.launchers.spec import LaunchSpec

KEY = "mpt/node-rank/{nr}"
"""The counter of node ``nr``'s claims in node 0's store."""


class RendezvousError(MptError, RuntimeError):
    """Node 0's store could not be reached within ``--rdzv-timeout``."""


class NodeRankClaim:
    """``with NodeRankClaim(spec): ...``: this node's rank claimed at node 0 for the block."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self._stores: list[TCPStore] = []

    def __enter__(self) -> NodeRankClaim:
        spec = self.spec
        if spec.nodes == 1:
            return self
        timeout = timedelta(seconds=spec.rdzv_timeout)
        try:
            if spec.nr == 0:  # the server the agent's store will share (multi_tenant)
                self._stores.append(TCPStore(spec.master_addr, spec.master_port, is_master=True,
                                             multi_tenant=True, wait_for_workers=False,
                                             timeout=timeout))
            client = TCPStore(spec.master_addr, spec.master_port, is_master=False,
                              wait_for_workers=False, timeout=timeout)
            self._stores.append(client)
            claims = client.add(KEY.format(nr=spec.nr), 1)
        except DistError as exc:
            self.close()
            raise RendezvousError(
                f"node {spec.nr} could not reach node 0 at {spec.master_addr}:"
                f"{spec.master_port} ({' '.join(str(exc).split())}); start `mpt launch --nr 0` "
                f"there within --rdzv-timeout ({spec.rdzv_timeout} s)") from None
        if claims > 1:
            self.close()
            raise UsageError("--nr", spec.nr, f"another node already joined the job at "
                             f"{spec.master_addr}:{spec.master_port} as node {spec.nr}",
                             f"give each of the {spec.nodes} nodes its own --nr in "
                             f"0..{spec.nodes - 1}")
        return self

    def close(self) -> None:
        self._stores.clear()  # the last reference to node 0's server stops it

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
