"""An elastic job on the emulated cluster (mpt.cluster) loses a node by a cut link, not a kill.

Three namespaces, each running `mpt launch --nodes 2:3` of tests/workers/elastic_train.py with
node 0's address as ``--master-addr`` and ``--timeout 10``. Node 2's link is taken down mid-run:
no socket closes, so the survivors' workers learn of it only when their collective times out;
their agents then meet again without node 2 (its keep-alives stop arriving) and finish at 2
processes. Node 2, cut off, does not end by itself within minutes (its agent waits on the
store it cannot reach); the test ends it, as the machine it stands for is gone.
Marked slow (make conformance): namespaces need root, and the timeouts take about a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import mpt_command, wait_for, worker
from test_elastic import GLOBAL_BATCH, STEPS, assert_every_sample_once_per_epoch, read_curve

sys.path.insert(0, str(Path(__file__).parents[1] / "cluster"))
from cluster_support import needs_cluster

from mpt.cluster import EmulatedCluster

PORT = 29611  # inside the cluster's own namespaces: no port of this machine is touched
COLLECTIVE_TIMEOUT = 10


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
            "--rdzv-timeout", "30", "--global-batch-size", str(GLOBAL_BATCH),
            "--checkpoint-dir", str(ck), worker("elastic_train.py"), str(out), "--steps",
            str(STEPS), "--sleep", "0.5"), env={**os.environ, "OMP_NUM_THREADS": "1"},
            output=log) for node, log in zip(cluster.members, logs, strict=True)]
        try:
            assert wait_for(lambda: sum(w == 3 for _, w, _, _ in read_curve(out)) >= 3, 150), \
                "the 3-node world never trained"
            subprocess.run(["ip", "link", "set", cluster.host_end(2), "down"], check=True)
            cut_at = time.time()
            codes = [proc.wait(240) for proc in procs[:2]]
            # The cut-off node's launcher waits on the store it cannot reach (torch's client
            # timeouts, minutes): it is ended here, as the lost machine it stands for.
            procs[2].kill()
            procs[2].wait(10)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for log in logs:
                log.close()
        assert wait_for(lambda: not any(node.pids() for node in cluster.members), 10), \
            "processes of the job outlived it"
    output = "\n".join((tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(3))
    assert codes == [0, 0], output
    rows = read_curve(out)
    assert rows[-1][:2] == (STEPS, 2), output
    assert_every_sample_once_per_epoch(out)
    first_after = min(t for _, world, _, t in rows if world == 2 and t > cut_at)
    print(f"\nelastic, cut link: 3 -> 2 nodes, cut to next completed step "
          f"{first_after - cut_at:.1f} s (--timeout {COLLECTIVE_TIMEOUT})")
