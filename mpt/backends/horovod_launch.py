"""What `mpt launch` without ``--hosts`` cannot give a Horovod job, refused before any process
starts (``HorovodBackend.check_launch``): the workers join over gloo through Horovod's
rendezvous server (``mpt.launchers.horovod_join``), which serves one round of workers, binds the
address the host name resolves to, and has no Adasum.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING

from mpt.backends.horovod import ADASUM_HINT
from mpt.errors import UsageError

if TYPE_CHECKING:
    from mpt.backends.base import Launch


def check_restarts(spec: Launch) -> None:
    """``--max-restarts`` is refused: the rendezvous server forgets a round's addresses only
    once every worker finished it, so a gang restarted after a failure half-way through could
    meet the dead round's addresses."""
    if spec.max_restarts:
        raise UsageError("--max-restarts", spec.max_restarts, "Horovod's rendezvous serves one "
                         "round of workers, and a restarted gang could meet the failed round's "
                         "addresses", "pass --max-restarts 0 with --backend horovod, or restart "
                         "the job from its checkpoint (--resume auto)")


def gloo_address() -> str | None:
    """The address Horovod's gloo binds for its collectives on this machine: the first its host
    name resolves to, as gloo's device takes it without an interface (see the module's
    docstring); None where the name does not resolve."""
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return str(found[0][4][0]) if found else None


def is_loopback(address: str) -> bool:
    """Whether ``address`` is an IP address of loopback (127.0.0.0/8, ::1); a name is not."""
    try:
        return ipaddress.ip_address(address.partition("%")[0]).is_loopback
    except ValueError:
        return False


def route_source(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host``: what ``host`` sees connections come
    from. A UDP socket's connect picks it and sends nothing. None where there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def own_address(spec: Launch) -> str:
    """The address the other nodes reach this one on, for a hint: the source of the route to
    node 0, else this machine's only IPv4 address beside loopback (node 0, whose
    ``--master-addr`` may be its own name), else ``ADDRESS``."""
    import psutil

    routed = route_source(spec.master_addr, spec.master_port)
    if routed is not None and not is_loopback(routed):
        return routed
    found = {a.address for addresses in psutil.net_if_addrs().values() for a in addresses
             if a.family == socket.AF_INET and not is_loopback(a.address)}
    return found.pop() if len(found) == 1 else "ADDRESS"


def unreachable_gloo(nodes: int, master_addr: str) -> str | None:
    """The loopback address Horovod's gloo would bind where this host name resolves to one and
    the job spans machines, so that the other nodes cannot reach this one; None where it can.
    A ``master_addr`` of loopback (127.0.0.1, ::1, localhost) says every node runs on this
    machine, where loopback serves."""
    if nodes == 1 or master_addr == "localhost" or is_loopback(master_addr):
        return None
    address = gloo_address()
    return address if address is not None and is_loopback(address) else None


def check_host_name(spec: Launch) -> None:
    """Refuse Horovod on several machines where this host name resolves to loopback: Horovod
    would bind 127.0.0.1 for every collective and the job would abort in gloo's connect after
    minutes (see the module's docstring)."""
    address = unreachable_gloo(spec.nodes, spec.master_addr)
    if address is None:
        return
    host = socket.gethostname()
    raise UsageError("--backend", "horovod", f"this node's host name {host} resolves to "
                     f"{address}, which Horovod's gloo binds for its collectives whatever "
                     "HOROVOD_GLOO_IFACE says, so the other nodes cannot reach this one",
                     f"map {host} to this node's address in /etc/hosts (the line "
                     f"'{own_address(spec)} {host}'), or train with --backend ddp or deepspeed "
                     "(on CPUs with GLOO_SOCKET_IFNAME naming the node's interface); with every "
                     "node on this machine pass --master-addr 127.0.0.1")


def check_op(spec: Launch) -> None:
    """``--horovod-op adasum`` is refused: Horovod runs Adasum only over MPI, and the workers of
    `mpt launch` without ``--hosts`` join over gloo (they would fail at the first allreduce)."""
    if str(spec.run.backend_options.get("op")) == "adasum":
        raise UsageError("--horovod-op", "adasum", "Horovod runs Adasum only over MPI, and the "
                         "workers of `mpt launch` without --hosts join over gloo", ADASUM_HINT)
