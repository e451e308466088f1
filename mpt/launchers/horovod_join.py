"""Horovod scripts under a plain `mpt launch`: ``hvd.init()`` joins the job.

horovodrun is not the only way into a Horovod job. Over gloo, ``hvd.init()`` meets its peers
through an HTTP key-value store (Horovod's rendezvous server) named by
``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``, and learns its place from ``HOROVOD_RANK``,
``HOROVOD_SIZE``, ``HOROVOD_LOCAL_*`` and ``HOROVOD_CROSS_*``. `mpt launch` (every backend;
horovodrun only starts the job when asked with ``--hosts``/``--hostfile``) hosts Horovod's own
server on node 0 and exports where it listens; each worker turns that into its Horovod variables
before the script runs (see ``mpt.launchers.worker``). So ``--backend horovod`` needs neither ssh
nor horovodrun: each node runs its own `mpt launch --nr R`, as a scheduler that starts one
launcher per node (SLURM, Kubernetes) does, and the workers also get torchrun's variables
(``RANK``, ``MASTER_ADDR``, ...), whose ranks are Horovod's. Without it, a Horovod script started
by `mpt launch --gpus 2` ran as two one-process Horovod jobs and said nothing.

Which address Horovod's gloo binds: ``HOROVOD_GLOO_IFACE`` reaches only its first, global
context; the contexts of its process sets, which carry every collective (process set 0 is the
whole job), bind the address this machine's host name resolves to, whatever the variable says.
``HOROVOD_HOSTNAME`` only names a node's scope in the rendezvous. So where the host name resolves
to loopback (Debian's ``127.0.1.1 HOST``), each rank offers the others 127.0.0.1 and a job across
machines fails in gloo's connect, after its timeouts: no variable can give Horovod the node's
address, and `mpt launch --backend horovod` refuses such a job before any process starts
(``mpt.backends.horovod_launch``), while ddp and deepspeed, whose gloo honours
``GLOO_SOCKET_IFNAME``, train. Adasum is refused there too: Horovod runs it only over MPI, and
these workers join over gloo.

The server is only started where Horovod imports. On one node it listens on a free port; on
several, node 0 listens on ``--master-port + 1``, the port every node can work out alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpt.environments import World
from mpt.environments.settings import HOROVOD_RENDEZVOUS
from mpt.errors import UsageError

if TYPE_CHECKING:  # every worker imports this module (join_env): not spec's torch
    from mpt.launchers.spec import LaunchSpec

NODE_NAME = "node{nr}"
"""Horovod's ``HOROVOD_HOSTNAME`` for node ``nr``: it only names the node's local rendezvous."""


def _server_classes() -> tuple[Any, Any, Any] | None:
    """Horovod's rendezvous server, request handler and slot record; None without Horovod."""
    try:
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
    except ImportError:
        return None
    return RendezvousHTTPServer, RendezvousHandler, SlotInfo


def rendezvous_port(world: World) -> int:
    """The port of a multi-node job's rendezvous on node 0 (0: one node picks a free one)."""
    return 0 if world.nodes == 1 else world.master_port + 1


def check_port(spec: LaunchSpec) -> None:
    """What this node must offer the job's Horovod, checked by `mpt launch` before it claims
    its node rank, so that every node refuses within seconds: node 0 of a multi-node job needs
    ``--master-port + 1`` free where Horovod is installed (scripts that call ``hvd.init()``
    themselves meet there under any backend; ``HorovodBackend.check_launch`` checks the
    rest)."""
    from mpt.launchers.spec import port_is_free

    if _server_classes() is None:
        return
    port = rendezvous_port(spec.world)
    if port and spec.nr == 0 and not port_is_free(port):
        raise UsageError("--master-port", spec.master_port, f"port {port} (--master-port + 1, "
                         "where node 0 hosts Horovod's rendezvous for scripts that call "
                         "hvd.init()) is in use on this node", "pick another --master-port")


@dataclass
class HorovodRendezvous:
    """Horovod's rendezvous server for one `mpt launch` (node 0), or only its address."""

    address: str
    """``host:port`` every worker's ``hvd.init()`` meets at ("" without Horovod)."""
    server: Any = None
    """The running server (node 0 only)."""
    thread: threading.Thread | None = None

    @classmethod
    def start(cls, spec: LaunchSpec) -> HorovodRendezvous:
        """Serve the job's rendezvous on node 0; the other nodes only need its address."""
        return cls.serve(spec.world)

    @classmethod
    def serve(cls, world: World) -> HorovodRendezvous:
        """Serve ``world``'s rendezvous (on ``rendezvous_port``) where ``world.nr`` is 0;
        elsewhere only its address. No address without Horovod."""
        classes = _server_classes()
        if classes is None:
            return cls(address="")
        master_addr, port = world.master_addr, rendezvous_port(world)
        if world.nr != 0:
            return cls(address=f"{master_addr}:{port}")
        server_class, handler, slot = classes
        server = server_class(("", port), handler, False)
        server.init([slot(hostname=NODE_NAME.format(nr=nr), rank=rank, local_rank=local,
                          cross_rank=nr, size=world.world_size, local_size=world.gpus,
                          cross_size=world.nodes)
                     for nr, local, rank in world.all_processes()])
        # Polled every 10 ms: what stop() waits at the end of every launch (socketserver's
        # default is 0.5 s); the wake-ups cost the launcher next to nothing.
        thread = threading.Thread(target=server.serve_forever, args=(0.01,),
                                  name="horovod-rendezvous", daemon=True)
        thread.start()
        return cls(address=f"{master_addr}:{server.server_address[1]}", server=server,
                   thread=thread)

    def env(self) -> dict[str, str]:
        """What the workers inherit: where the rendezvous is, for ``join_env``."""
        return {HOROVOD_RENDEZVOUS: self.address} if self.address else {}

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def join_env(world: World, address: str) -> dict[str, str]:
    """Horovod's variables that make this worker's ``hvd.init()`` join the job at ``address``."""
    host, _, port = address.rpartition(":")
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": host, "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_HOSTNAME": NODE_NAME.format(nr=world.nr),
        "HOROVOD_RANK": str(world.rank), "HOROVOD_SIZE": str(world.world_size),
        "HOROVOD_LOCAL_RANK": str(world.local_rank), "HOROVOD_LOCAL_SIZE": str(world.gpus),
        "HOROVOD_CROSS_RANK": str(world.nr), "HOROVOD_CROSS_SIZE": str(world.nodes),
    }
