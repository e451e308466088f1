"""The emulated cluster itself, on real namespaces: nodes reach each other at the shaped rate and
nothing else, and every namespace, link, hosts file and process is gone after a clean, a failed
and a timed-out run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from cluster_support import needs_cluster
from conftest import pid_alive, wait_for

from mpt.cluster import ClusterError, EmulatedCluster, LinkShape, run_nodes
from mpt.cluster.netns import NETNS_ETC, links, namespaces

SINK = """
import socket, sys
server = socket.create_server((sys.argv[1], 5000))
server.settimeout(20)
peer, _ = server.accept()
got = 0
while data := peer.recv(1 << 20):
    got += len(data)
print("received", got)
"""

SOURCE = """
import socket, sys, time
deadline = time.monotonic() + 20
while True:
    try:
        peer = socket.create_connection((sys.argv[1], 5000), timeout=20)
        break
    except ConnectionRefusedError:
        assert time.monotonic() < deadline
        time.sleep(0.05)
started = time.monotonic()
for _ in range(int(sys.argv[2])):
    peer.sendall(bytes(1 << 20))
peer.close()
print("seconds", time.monotonic() - started)
"""

SLEEPER = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"


def gone(cluster: EmulatedCluster, pids: list[int]) -> None:
    assert cluster.leftovers() == set()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


@needs_cluster
def test_nodes_meet_at_their_addresses_at_the_shaped_rate_and_nothing_is_left(tmp_path):
    with EmulatedCluster(nodes=2, shape=LinkShape(rate="200mbit")) as cluster:
        a, b = cluster.members
        assert a.address != b.address and cluster.subnet is not None
        assert {a.namespace, b.namespace} <= namespaces() and cluster.bridge in links()
        routes = subprocess.run(["ip", "netns", "exec", a.namespace, "ip", "route"],
                                capture_output=True, text=True, check=True).stdout
        assert routes.split()[0] == str(cluster.subnet) and "default" not in routes
        megabytes = 10  # 0.42 s at 200 Mbit/s
        run = run_nodes(cluster, [[sys.executable, "-c", SOURCE, b.address, str(megabytes)],
                                  [sys.executable, "-c", SINK, b.address]], timeout=30)
        assert run.ok, run.report()
        assert run.nodes[1].output.split() == ["received", str(megabytes << 20)]
        seconds = float(run.nodes[0].output.split()[1])
        # the tbf's rate: an unshaped veth here moves it in 0.01 s; the sender may finish up to
        # a socket buffer early, and later on a loaded machine
        assert 0.4 < megabytes * 8 * 2**20 / 200e6 / seconds < 1.5, seconds
    gone(cluster, [])


@needs_cluster
@pytest.mark.parametrize("loopback_names", [False, True])
def test_each_node_resolves_its_own_names_to_its_address_or_to_loopback(loopback_names):
    """A node's hosts file: its own names (this machine's host name, ``node<i>``) name its
    address, or 127.0.0.1 as on a Debian node with ``loopback_names``; the others', theirs."""
    with EmulatedCluster(nodes=2, loopback_names=loopback_names) as cluster:
        for node in cluster.members:
            names = [socket.gethostname(), *(f"node{j}" for j in range(cluster.nodes))]
            found = subprocess.run(["ip", "netns", "exec", node.namespace, "getent", "hosts",
                                    *names], capture_output=True, text=True, check=True)
            own = "127.0.0.1" if loopback_names else node.address
            assert [line.split()[0] for line in found.stdout.splitlines()] == [
                own, *(own if other is node else other.address for other in cluster.members)]
    gone(cluster, [])


@needs_cluster
def test_a_failure_inside_the_block_kills_its_processes_and_removes_everything(tmp_path):
    with pytest.raises(KeyError), EmulatedCluster(nodes=2) as cluster:
        with open(tmp_path / "out", "w") as out:
            cluster.members[1].popen([sys.executable, "-c", SLEEPER, str(tmp_path / "pid")],
                                     env=dict(os.environ), output=out)
        pid = tmp_path / "pid"
        assert wait_for(lambda: pid.exists() and bool(pid.read_text()), 60), "no sleeper started"
        raise KeyError("the test's own failure")
    gone(cluster, [int((tmp_path / "pid").read_text())])


@needs_cluster
def test_a_timed_out_run_is_killed_on_every_node_and_reports_it(tmp_path):
    with EmulatedCluster(nodes=2) as cluster:
        commands = [[sys.executable, "-c", f"print('node {nr} up', flush=True); " + SLEEPER,
                     str(tmp_path / f"pid{nr}")] for nr in range(2)]
        started = time.monotonic()
        run = run_nodes(cluster, commands, timeout=3)
        assert time.monotonic() - started < 15
        assert run.timed_out and [n.exit_code for n in run.nodes] == [None, None]
        assert [n.output for n in run.nodes] == ["node 0 up\n", "node 1 up\n"]
        pids = [int((tmp_path / f"pid{nr}").read_text()) for nr in range(2)]
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
        assert all(node.pids() == [] for node in cluster.members)
    gone(cluster, pids)


@needs_cluster
def test_a_sigterm_to_the_process_that_holds_the_cluster_removes_everything(tmp_path):
    # what `timeout` or a scheduler sends: the process exits 143 and leaves nothing behind
    holder = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, time
from mpt.cluster import EmulatedCluster
with EmulatedCluster(nodes=2) as cluster:
    with open({str(tmp_path / "out")!r}, "w") as out:
        cluster.members[0].popen([sys.executable, "-c", {SLEEPER!r}, {str(tmp_path / "pid")!r}],
                                 env=dict(os.environ), output=out)
    print(cluster.prefix, flush=True)
    time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        prefix = holder.stdout.readline().strip()
        pid = tmp_path / "pid"
        assert wait_for(lambda: pid.exists() and bool(pid.read_text()), 60), "no sleeper started"
        holder.terminate()
        assert holder.wait(timeout=60) == 143
    finally:
        holder.kill()
    assert prefix.startswith("mpt")
    made = namespaces() | links() | {p.name for p in NETNS_ETC.glob("*")}
    assert {name for name in made if name.startswith(f"{prefix}-")} == set()
    assert not pid_alive(int((tmp_path / "pid").read_text()))


@needs_cluster
def test_a_cluster_that_fails_half_built_removes_what_it_built():
    # tc refuses the rate once the bridge, the first namespace and its link exist
    cluster = EmulatedCluster(nodes=2, shape=LinkShape(rate="0.0001bit"))
    with pytest.raises(ClusterError, match="tc qdisc add"):
        cluster.open()
    assert cluster.prefix and cluster.leftovers() == set()
    assert not (NETNS_ETC / f"{cluster.prefix}-n0").exists()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_without_the_capabilities_it_says_so_in_one_line():
    # the same process, less CAP_NET_ADMIN and CAP_SYS_ADMIN: the reason the tests skip with
    result = subprocess.run(["setpriv", "--bounding-set=-net_admin,-sys_admin", sys.executable,
                             "-c", "from mpt.cluster import unavailable_reason; "
                             "print(unavailable_reason())"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ("the emulated cluster needs CAP_NET_ADMIN and CAP_SYS_ADMIN (network "
                             "namespaces); run as root or grant them\n")
