"""Elastic jobs on the emulated cluster (mpt.cluster): a node lost by a cut link, and a node
killed with its snapshot store.

Cut link: three namespaces, each running `mpt launch --nodes 2:3` of
tests/workers/elastic_train.py with node 0's address as ``--master-addr`` and ``--timeout 10``.
Node 2's link is taken down mid-run: no socket closes, so the survivors' workers learn of it
only when their collective times out; their agents then meet again without node 2 (its keep-
alives stop arriving) and finish at 2 processes. Node 2, cut off, ends by itself once the
rendezvous host has been unreachable for ``--rdzv-timeout`` (its agent, blocked in a store
request that never returns, could not): one line, exit code 1, no process left.

Killed node: four nodes at 10 Gbit/s under fsdp, a snapshot every step in each node's own store,
the rendezvous on a store of a fifth namespace (any node may be lost). Rank 0's node is
SIGKILLed and its store deleted: the three survivors resume from the copy its peer node holds,
at most one step back, and finish on the curve of a run that never lost a node.

Marked slow (make conformance): namespaces need root, and the timeouts take about a minute.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest
from conftest import mpt_command, wait_for, worker
from test_elastic import (
    BACKENDS,
    GLOBAL_BATCH,
    STEPS,
    STORE,
    assert_every_sample_once_per_epoch,
    check_shrunk,
    read_curve,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "cluster"))
from cluster_support import needs_cluster

from mpt.cluster import EmulatedCluster, LinkShape
from mpt.cluster.netns import kill_namespace

PORT = 29611  # inside the cluster's own namespaces: no port of this machine is touched
COLLECTIVE_TIMEOUT = 10
RDZV_TIMEOUT = 30


@pytest.mark.slow
@needs_cluster
def test_a_cut_link_shrinks_the_job_after_the_collective_timeout(tmp_path):
    out, ck = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    with EmulatedCluster(nodes=3) as cluster:
        master = cluster.members[0].address
        logs = [(tmp_path / f"node{i}.log").open("w") for i in range(3)]
        # Every namespace shares the machine's host name: each node says its own address.
        procs = [node.popen(mpt_command(
            "launch", "--nodes", "2:3", "--master-addr", master, "--master-port", str(PORT),
            "--local-addr", node.address, "--timeout", str(COLLECTIVE_TIMEOUT),
            "--rdzv-timeout", str(RDZV_TIMEOUT), "--global-batch-size", str(GLOBAL_BATCH),
            "--checkpoint-dir", str(ck), worker("elastic_train.py"), str(out), "--steps",
            str(STEPS), "--sleep", "0.5"), env={**os.environ, "OMP_NUM_THREADS": "1"},
            output=log) for node, log in zip(cluster.members, logs, strict=True)]
        try:
            assert wait_for(lambda: sum(w == 3 for _, w, _, _ in read_curve(out)) >= 3, 150), \
                "the 3-node world never trained"
            subprocess.run(["ip", "link", "set", cluster.host_end(2), "down"], check=True)
            cut_at = time.time()
            codes = [proc.wait(240) for proc in procs[:2]]
            # The cut-off node: the rendezvous timeout after its last probe, and a probe or two
            codes.append(procs[2].wait(max(1.0, cut_at + RDZV_TIMEOUT + 15 - time.time())))
            cut_off_after = time.time() - cut_at
        finally:
            stop(procs, logs)
        assert wait_for(lambda: not any(node.pids() for node in cluster.members), 10), \
            "processes of the job outlived it"
    output = "\n".join((tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(3))
    assert codes == [0, 0, 1], output
    said = [line for line in (tmp_path / "node2.log").read_text().splitlines()
            if "it is cut off from the job" in line]
    assert len(said) == 1 and f"(--rdzv-timeout {RDZV_TIMEOUT})" in said[0], output
    rows = read_curve(out)
    assert rows[-1][:2] == (STEPS, 2), output
    assert_every_sample_once_per_epoch(out)
    first_after = min(t for _, world, _, t in rows if world == 2 and t > cut_at)
    print(f"\nelastic, cut link: 3 -> 2 nodes, cut to next completed step "
          f"{first_after - cut_at:.1f} s (--timeout {COLLECTIVE_TIMEOUT}); the cut-off node "
          f"ended after {cut_off_after:.1f} s (--rdzv-timeout {RDZV_TIMEOUT})")


@pytest.mark.slow
@needs_cluster
def test_a_killed_node_costs_at_most_one_step_from_its_peers_snapshot(tmp_path):
    out, ck, run_dir = tmp_path / "out", tmp_path / "ck", tmp_path / "run"
    out.mkdir()
    memory = [tmp_path / f"memory{nr}" for nr in range(4)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with EmulatedCluster(nodes=5, shape=LinkShape(rate="10gbit")) as cluster:
        *nodes, host = cluster.members
        logs = [(tmp_path / f"node{i}.log").open("w") for i in range(5)]
        procs = [host.popen([sys.executable, "-c", STORE, str(PORT)], env=env, output=logs[4])]
        procs += [node.popen(mpt_command(
            "launch", "--nodes", "3:4", "--master-addr", host.address, "--master-port",
            str(PORT), "--local-addr", node.address, *BACKENDS["fsdp"], "--global-batch-size",
            str(GLOBAL_BATCH), "--checkpoint-dir", str(ck), "--run-dir", str(run_dir),
            "--snapshot-every", "1", "--snapshot-dir", str(store), worker("elastic_train.py"),
            str(out), "--steps", str(STEPS), "--sleep", "0.2", "--save-every", str(STEPS)),
            env=env, output=log) for node, store, log in zip(nodes, memory, logs[:4], strict=True)]
        try:
            assert wait_for(lambda: sum(w == 4 for _, w, _, _ in read_curve(out)) >= 3, 180), \
                "the 4-node world never trained"
            rank0 = {int(p.name) for p in (out / "pids").iterdir() if p.read_text() == "0"}
            lost = next(i for i, node in enumerate(nodes) if rank0 & set(node.pids()))
            kill_namespace(nodes[lost].namespace)
            killed_at = time.time()
            shutil.rmtree(memory[lost])  # its memory is gone with it
            codes = [proc.wait(240) for i, proc in enumerate(procs[1:]) if i != lost]
        finally:
            stop(procs, logs)
    output = "\n".join((tmp_path / f"node{i}.log").read_text() for i in range(4) if i != lost)
    assert codes == [0, 0, 0], output[-6000:]
    restored = check_shrunk(tmp_path, out, run_dir, "fsdp", killed_at, output,
                            " on the cluster at 10 Gbit/s, rank 0's node lost with its store",
                            worlds=(4, 3))
    assert f"resumed from memory://mpt-snapshot/step-{restored:09d}" in output, output[-6000:]


def stop(procs: list[subprocess.Popen[str]], logs: list[IO[str]]) -> None:
    """Kill what is still running of a cluster job, and close its nodes' logs."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for log in logs:
        log.close()
