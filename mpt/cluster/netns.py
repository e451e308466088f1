"""An emulated cluster on one machine: network namespaces on a bridge, links shaped by tc.

Multi-node behaviour (a rendezvous across addresses, collectives over a limited link) cannot be
seen with every rank on 127.0.0.1, where an allreduce crosses shared memory. Each "node" here is
a network namespace with its own interface and address; the nodes meet on a bridge in the root
namespace, and each node's outgoing link is limited by a tc token bucket (and, where the kernel
has netem, delayed or lossy).

The life of one cluster, every step undone by ``close()`` on every exit path (``with`` block,
a failure half-way through building, a timed-out run):

1. A name prefix unique to this cluster (``mpt`` and 6 random hex digits, checked against the
   namespaces and links that exist) names each resource, so that parallel clusters and leftovers
   of a killed one never collide.
2. A /24 in 10.78.0.0/16 that no route and no address of this machine covers: the nodes only
   ever talk to each other. The bridge has no address, so the root namespace has no route into
   the cluster, and a node has no route out of it.
3. A bridge; per node a namespace ``<prefix>-n<i>``, a veth pair whose host end ``<prefix>-<i>``
   joins the bridge and whose node end is ``eth0`` inside the namespace, the address ``.i+1``,
   ``lo`` up, the qdiscs of ``LinkShape`` on ``eth0``, and ``/etc/netns/<namespace>/hosts``,
   which ``ip netns exec`` mounts over ``/etc/hosts``: the machine's host name and ``node<i>``
   resolve to the node's address there (as a cluster node's do), and ``node<j>`` to node j's.
   Horovod 0.28.1 needs the first: its process-set contexts ignore ``HOROVOD_GLOO_IFACE`` and
   bind the address of the host name, which this machine's ``/etc/hosts`` maps to 127.0.0.1.
   ``loopback_names`` maps the node's own names to 127.0.0.1 instead, as Debian's default
   ``/etc/hosts`` does on a real node.
4. ``Node.popen`` starts a process inside a namespace (``ip netns exec``), in a session of its
   own.
5. ``close()`` (also on SIGTERM, which an open cluster turns into SystemExit where nothing else
   handles it): SIGKILL to every process in each namespace (``ip netns pids``, which also finds
   processes that left their session), then the namespaces and their hosts files, the host ends
   of the veth pairs (some kernels, gVisor's among them, keep them when the namespace goes) and
   the bridge.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO

from mpt.errors import MptError

NODE_IFACE = "eth0"
"""The node's interface inside its namespace (what GLOO_SOCKET_IFNAME names)."""

POOL = ipaddress.ip_network("10.78.0.0/16")
"""Where a cluster's /24 is taken from."""

NETNS_ETC = Path("/etc/netns")
"""Where ``ip netns exec NAME`` finds files it mounts over ``/etc`` (iproute2's convention)."""

_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21


class ClusterError(MptError, RuntimeError):
    """A step of building or removing the emulated cluster failed; names the command."""


def unavailable_reason() -> str | None:
    """Why no emulated cluster can be built here, in one line; None when it can.

    Namespaces need CAP_SYS_ADMIN (``ip netns add`` mounts) and CAP_NET_ADMIN (links, qdiscs);
    both are read from this process's effective capabilities, not guessed from the uid.
    """
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"the emulated cluster needs {' and '.join(missing)} (iproute2), which is not on "
                "PATH")
    try:
        with open("/proc/self/status") as status:
            caps = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return "the emulated cluster needs CAP_NET_ADMIN, and /proc/self/status does not say"
    lacking = [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"),
                                      (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN")) if not caps >> bit & 1]
    if lacking:
        return (f"the emulated cluster needs {' and '.join(lacking)} (network namespaces); run "
                "as root or grant them")
    return None


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and result.returncode:
        raise ClusterError(f"`{' '.join(command)}` failed: "
                           f"{result.stderr.strip() or result.returncode}")
    return result


def namespaces() -> set[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    return {line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines()
            if line.strip()}


def links() -> set[str]:
    """Names of the root namespace's links (without the ``@peer`` suffix)."""
    return {line.split()[0].split("@")[0]
            for line in _run("ip", "-br", "link").stdout.splitlines() if line.strip()}


def free_subnet(rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A /24 of ``POOL`` that no route (but the default) and no address here overlaps."""
    taken = [ipaddress.ip_network(line.split()[0], strict=False)
             for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines()
             if line.split() and line.split()[0][0].isdigit()]
    for line in _run("ip", "-4", "-o", "addr").stdout.splitlines():
        words = line.split()
        if "inet" in words:
            taken.append(ipaddress.ip_network(words[words.index("inet") + 1], strict=False))
    candidates = list(POOL.subnets(new_prefix=24))
    (rng or random.Random()).shuffle(candidates)
    for subnet in candidates:
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise ClusterError(f"every /24 of {POOL} is routed on this machine; free one")


def namespace_pids(namespace: str) -> list[int]:
    """Every process in ``namespace``."""
    result = _run("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def kill_namespace(namespace: str) -> None:
    """SIGKILL every process in ``namespace`` until none is left (a dying launcher may still
    fork), for at most 10 s."""
    deadline = time.monotonic() + 10
    while (pids := namespace_pids(namespace)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkShape:
    """What each node's outgoing link can do: a rate, and optionally delay and loss."""

    rate: str = "1gbit"
    """tc's rate: ``1gbit``, ``10gbit``, ``500mbit``."""
    delay_ms: float = 0.0
    """One-way delay added to each packet (netem)."""
    loss_percent: float = 0.0
    """Share of packets dropped (netem)."""

    def rate_bits(self) -> float:
        """The rate in bits per second, for the ring-allreduce bound."""
        units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bit": 1.0}
        for unit, factor in units.items():
            if self.rate.endswith(unit):
                return float(self.rate.removesuffix(unit)) * factor
        raise ClusterError(f"rate {self.rate!r} is not <number>kbit|mbit|gbit|tbit")

    def tc_commands(self, iface: str) -> list[list[str]]:
        """The ``tc`` commands that shape ``iface``: a tbf, under a netem when delay or loss is
        asked for (netem's man page: its child shapes what it delays). The bucket holds at least
        one timer tick (250 Hz) of traffic, else tbf cannot reach the rate."""
        burst = max(512 * 1024, int(self.rate_bits() / 8 / 250))
        tbf = ["tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"]
        base = ["tc", "qdisc", "add", "dev", iface]
        if not (self.delay_ms or self.loss_percent):
            return [[*base, "root", *tbf]]
        netem = ["netem", "limit", "100000"]
        if self.delay_ms:
            netem += ["delay", f"{self.delay_ms}ms"]
        if self.loss_percent:
            netem += ["loss", f"{self.loss_percent}%"]
        return [[*base, "root", "handle", "1:", *netem],
                [*base, "parent", "1:1", "handle", "10:", *tbf]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One emulated node: its namespace, its address, its interface."""

    nr: int
    namespace: str
    address: str
    iface: str = NODE_IFACE

    def env(self) -> dict[str, str]:
        """What a process on this node needs so that gloo (torch's and Horovod's) binds the
        node's interface: neither can tell it from the hostname, which every node shares."""
        return {"GLOO_SOCKET_IFNAME": self.iface, "HOROVOD_GLOO_IFACE": self.iface}

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str], output: IO[str],
              cwd: str | None = None) -> subprocess.Popen[str]:
        """Start ``argv`` on this node, stdout and stderr into ``output``, in its own session."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace, *argv],
                                env={**env, **self.env()}, stdout=output,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                cwd=cwd, start_new_session=True)

    def pids(self) -> list[int]:
        """Every process in this node's namespace."""
        return namespace_pids(self.namespace)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@dataclass(kw_only=True)
class EmulatedCluster:
    """``nodes`` namespaces on one bridge, each link shaped by ``shape``; use it with ``with``."""

    nodes: int
    shape: LinkShape = field(default_factory=LinkShape)
    loopback_names: bool = False
    """Whether each node's own names (this machine's host name and ``node<i>``) resolve to
    127.0.0.1 on that node, as Debian's default ``/etc/hosts`` maps a host's name (the other
    nodes' names still resolve to their addresses); False: to the node's address."""
    prefix: str = ""
    """Set by ``open()``: the unique prefix of every resource name."""
    subnet: ipaddress.IPv4Network | None = None
    members: list[Node] = field(default_factory=list)
    _created: list[tuple[str, str]] = field(default_factory=list)
    """("netns" | "link" | "etc", name) of everything made so far, in order."""
    _sigterm: object = None
    """SIGTERM's handler before ``open()`` made it an exit (see ``_exit_on_sigterm``)."""

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def host_end(self, nr: int) -> str:
        return f"{self.prefix}-{nr}"

    def open(self) -> EmulatedCluster:
        """Build the cluster (steps 1-3 of the module docstring); on failure, remove what was
        built and raise."""
        if self.nodes < 1 or self.nodes > 250:
            raise ClusterError(f"nodes={self.nodes}: an emulated cluster has 1..250 nodes")
        reason = unavailable_reason()
        if reason:
            raise ClusterError(reason)
        self.shape.rate_bits()  # a bad rate before anything is built
        self._exit_on_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        existing = namespaces() | links()
        while not self.prefix or any(name.startswith(self.prefix) for name in existing):
            self.prefix = f"mpt{secrets.token_hex(3)}"
        self.subnet = free_subnet()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        addresses = [str(a) for a in itertools.islice(self.subnet.hosts(), self.nodes)]
        for nr, address in enumerate(addresses):
            node = Node(nr=nr, namespace=f"{self.prefix}-n{nr}", address=address)
            _run("ip", "netns", "add", node.namespace)
            self._created.append(("netns", node.namespace))
            _run("ip", "link", "add", self.host_end(nr), "type", "veth", "peer", "name",
                 node.iface, "netns", node.namespace)
            self._created.append(("link", self.host_end(nr)))
            _run("ip", "link", "set", self.host_end(nr), "master", self.bridge)
            _run("ip", "link", "set", self.host_end(nr), "up")
            inside = ("ip", "netns", "exec", node.namespace)
            _run(*inside, "ip", "addr", "add", f"{node.address}/24", "dev", node.iface)
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "link", "set", node.iface, "up")
            for command in self.shape.tc_commands(node.iface):
                _run(*inside, *command)
            self._write_hosts(node, addresses)
            self.members.append(node)

    def _write_hosts(self, node: Node, addresses: list[str]) -> None:
        """The node's ``/etc/hosts`` (step 3)."""
        folder = NETNS_ETC / node.namespace
        folder.mkdir(parents=True, exist_ok=True)
        self._created.append(("etc", str(folder)))
        own = "127.0.0.1" if self.loopback_names else node.address
        lines = ["127.0.0.1 localhost", f"{own} {socket.gethostname()} node{node.nr}",
                 *(f"{address} node{j}" for j, address in enumerate(addresses)
                   if j != node.nr)]
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    def _exit_on_sigterm(self) -> None:
        """SIGTERM (``timeout``, a scheduler) would end the process without unwinding, and the
        namespaces would outlive it: while the cluster is open it raises SystemExit instead, so
        ``close()`` runs. Only where nobody handles SIGTERM yet, and only in the main thread
        (the only one that can set handlers)."""
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            self._sigterm = signal.signal(signal.SIGTERM, _raise_exit)

    def close(self) -> None:
        """Step 5: every process, namespace and link of this cluster, gone; idempotent."""
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)  # type: ignore[arg-type]
            self._sigterm = None
        for kind, name in reversed(self._created):
            if kind == "netns":
                kill_namespace(name)
        errors = []
        for kind, name in self._created:  # namespaces first: their veth ends go with them
            if kind == "netns":
                result = _run("ip", "netns", "del", name, check=False)
                if result.returncode and name in namespaces():
                    errors.append(f"netns {name}: {result.stderr.strip()}")
            elif kind == "etc":
                shutil.rmtree(name, ignore_errors=True)
                with contextlib.suppress(OSError):  # another cluster may still use it
                    NETNS_ETC.rmdir()
        for kind, name in reversed(self._created):  # host veth ends, then the bridge
            if kind == "link" and name in links():
                result = _run("ip", "link", "del", name, check=False)
                if result.returncode and name in links():
                    errors.append(f"link {name}: {result.stderr.strip()}")
        self._created.clear()
        self.members.clear()
        if errors:
            raise ClusterError(f"could not remove {'; '.join(errors)}")

    def leftovers(self) -> set[str]:
        """Namespaces and links named with this cluster's prefix that exist now (for tests)."""
        made = namespaces() | links() | {p.name for p in NETNS_ETC.glob("*")}
        return {name for name in made if self.prefix and name.startswith(f"{self.prefix}-")}

    def __enter__(self) -> EmulatedCluster:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
