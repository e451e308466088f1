"""Jobs of two nodes at two addresses behind shaped links, each node its own `mpt launch --nr R`,
under every backend: they train as a one-node job of the same world size does, a checkpoint of
one resumes on one node, a node that never arrives ends the job in one line, and bad node ranks
are refused.

`make test` runs each backend once (2 nodes x 1 process, against one process of plain torch doing
the job's maths; ddp through a checkpoint resumed on one node); `make conformance` runs 2 x 1 and
2 x 2 under each against a real one-node job of the same world size.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import time

import pytest
from cluster_support import (
    WORKER,
    assert_same_training,
    needs_cluster,
    read_ranks,
    reference,
    run_job,
)
from conftest import run_mpt

from mpt.cluster import EmulatedCluster, launch_command, run_nodes

STEPS, STOP = 6, 3
PORT = 29500  # each node is a namespace of its own: no other job's port to collide with
BACKENDS = ("ddp", "apex", "horovod", "deepspeed", "fsdp")
HOROVOD = importlib.util.find_spec("horovod") is not None


def backend_param(backend: str, gpus: int, *marks: pytest.MarkDecorator) -> object:
    needs = [pytest.mark.skipif(not HOROVOD, reason="needs horovod (mpt install horovod)")] \
        if backend == "horovod" else []
    return pytest.param(backend, gpus, marks=[*needs, *marks], id=f"{backend}-2x{gpus}")


@needs_cluster
@pytest.mark.parametrize(("backend", "gpus"), [backend_param(b, 1) for b in BACKENDS
                                               if b != "ddp"])
def test_two_nodes_train_as_the_maths_of_one_node_says(tmp_path, backend, gpus):
    with EmulatedCluster(nodes=2) as cluster:
        run = run_job(cluster, tmp_path, STEPS, gpus=gpus, port=PORT,
                      launch_args=("--backend", backend))
    assert run.ok, run.report()
    ranks = read_ranks(tmp_path, 2 * gpus)
    assert [(r["rank"], r["nr"], r["nodes"], r["backend"]) for r in ranks] == [
        (rank, rank // gpus, 2, backend) for rank in range(2 * gpus)]
    assert_same_training(ranks, reference(2 * gpus, STEPS))


@needs_cluster
def test_a_checkpoint_of_two_nodes_resumes_on_one_node(tmp_path):
    two, resumed = tmp_path / "two", tmp_path / "resumed"
    for folder in (two, resumed):
        folder.mkdir()
    ckpt = str(tmp_path / "ckpt")
    with EmulatedCluster(nodes=2) as cluster:
        run = run_job(cluster, two, STEPS, gpus=1, port=PORT, stop=STOP,
                      launch_args=("--checkpoint-dir", ckpt))
    assert run.ok, run.report()
    result = run_mpt("launch", "--gpus", "2", "--master-port", "auto", "--checkpoint-dir", ckpt,
                     "--resume", "auto", str(WORKER), str(resumed), str(STEPS), timeout=180)
    assert result.returncode == 0, result.stderr
    joined = []
    for before, after in zip(read_ranks(two, 2), read_ranks(resumed, 2), strict=True):
        assert (before["nodes"], after["nodes"], after["start"]) == (2, 1, STOP)
        joined.append({"losses": {**before["losses"], **after["losses"]},
                       "params": after["params"]})
    assert_same_training(joined, reference(2, STEPS))  # as if never interrupted


@needs_cluster
@pytest.mark.slow  # make test: the duplicate --nr test's waiting node ends the same way
def test_a_node_that_never_arrives_ends_the_job_within_the_rendezvous_timeout(tmp_path):
    with EmulatedCluster(nodes=2) as cluster:
        node0 = launch_command(cluster, 0, WORKER,
                               [str(tmp_path), str(STEPS)], master_port=PORT,
                               launch_args=("--rdzv-timeout", "3"))
        started = time.monotonic()
        run = run_nodes(cluster, [node0, None], timeout=60)
        seconds = time.monotonic() - started
    assert not run.timed_out and run.nodes[0].exit_code == 1, run.report()
    assert seconds < 3 + 15
    said = [line for line in run.nodes[0].output.splitlines() if line.startswith("mpt: node")]
    assert len(said) == 1 and "could not meet the other nodes" in said[0]
    assert "within --rdzv-timeout (3 s)" in said[0]


@needs_cluster
def test_two_nodes_given_the_same_node_rank_are_caught_at_the_rendezvous(tmp_path):
    with EmulatedCluster(nodes=2) as cluster:
        node0 = launch_command(cluster, 0, WORKER, [str(tmp_path), str(STEPS)], master_port=PORT,
                               launch_args=("--rdzv-timeout", "3"))
        run = run_nodes(cluster, [node0, node0], timeout=60)  # node 1 says --nr 0 as well
        address = cluster.members[0].address
    assert not run.timed_out, run.report()
    # whichever claimed node 0 second stops at once; the other is a node short and times out
    refused = [n for n in run.nodes if n.exit_code == 2]
    waited = [n for n in run.nodes if n.exit_code == 1]
    assert len(refused) == len(waited) == 1, run.report()
    said = [line for line in refused[0].output.splitlines() if line.startswith("mpt: error")]
    assert said == ["mpt: error: --nr=0 is invalid: another node already joined the job at "
                    f"{address}:{PORT} as node 0. Fix: give each of the 2 "
                    "nodes its own --nr in 0..1"], refused[0].output
    assert any("--rdzv-timeout (3 s)" in line for line in waited[0].output.splitlines())


@needs_cluster
@pytest.mark.slow
@pytest.mark.parametrize(("backend", "gpus"), [backend_param(b, g) for b in BACKENDS
                                               for g in (1, 2)])
def test_two_nodes_train_as_a_one_node_job_of_the_same_world_size(tmp_path, backend, gpus):
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    with EmulatedCluster(nodes=2) as cluster:
        run = run_job(cluster, two, STEPS, gpus=gpus, port=PORT,
                      launch_args=("--backend", backend))
    assert run.ok, run.report()
    result = run_mpt("launch", "--gpus", str(2 * gpus), "--backend", backend, "--master-port",
                     "auto", str(WORKER), str(one), str(STEPS), timeout=240)
    assert result.returncode == 0, result.stderr
    got, want = read_ranks(two, 2 * gpus), read_ranks(one, 2 * gpus)
    assert {r["nodes"] for r in got} == {2} and {r["nodes"] for r in want} == {1}
    assert_same_training(got, want)


@needs_cluster
@pytest.mark.skipif(not HOROVOD, reason="needs horovod (mpt install horovod)")
def test_horovod_where_host_names_resolve_to_loopback_is_refused_on_every_node_at_once(tmp_path):
    """Each node's host name maps to 127.0.0.1 (Debian's default), and `--master-addr node0` is
    node 0's own name there: Horovod would bind loopback for every collective whatever
    HOROVOD_GLOO_IFACE says, and the job aborted in gloo's connect after minutes. Each node
    now refuses before its processes start, naming the hosts line that fixes it."""
    with EmulatedCluster(nodes=2, loopback_names=True) as cluster:
        run = run_job(cluster, tmp_path, STEPS, gpus=1, port=PORT, master_addr="node0",
                      launch_args=("--backend", "horovod"), timeout=60)
        addresses = [node.address for node in cluster.members]
    assert not run.timed_out and run.seconds < 30, run.report()
    host = socket.gethostname()
    for node, address in zip(run.nodes, addresses, strict=True):
        said = [line for line in node.output.splitlines() if line.startswith("mpt: ")]
        assert node.exit_code == 2 and len(said) == 1, run.report()
        assert said[0].startswith(f"mpt: error: --backend=horovod is invalid: this node's host "
                                  f"name {host} resolves to 127.0.0.1"), said
        assert f"(the line '{address} {host}')" in said[0]
    assert not list(tmp_path.glob("rank*.json"))  # no worker started


@needs_cluster
@pytest.mark.parametrize("backend", [pytest.param(b, marks=[pytest.mark.slow] if b != "ddp"
                                                  else []) for b in BACKENDS if b != "horovod"])
def test_nodes_whose_host_names_resolve_to_loopback_train_under_the_other_backends(tmp_path,
                                                                                    backend):
    """torch's gloo binds the interface GLOO_SOCKET_IFNAME names (set here as a node's job
    script would; without it, it binds the host name's loopback too)."""
    with EmulatedCluster(nodes=2, loopback_names=True) as cluster:
        run = run_job(cluster, tmp_path, STEPS, gpus=1, port=PORT, master_addr="node0",
                      launch_args=("--backend", backend))
    assert run.ok, run.report()
    assert_same_training(read_ranks(tmp_path, 2), reference(2, STEPS))


@pytest.mark.parametrize("nr", ["2", "-1", "one"])
def test_a_node_rank_outside_the_job_is_refused_before_start(run_cli, nr):
    result = run_cli("launch", "--nodes", "2", "--nr", nr, "--master-addr", "10.0.0.1",
                     str(WORKER))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"mpt: error: --nr={nr}")
    assert "Fix:" in result.stderr
    if nr != "one":
        assert "pass --nr between 0 and 1" in result.stderr


@pytest.mark.skipif(not HOROVOD, reason="needs horovod (mpt install horovod)")
def test_horovod_workers_also_get_torchruns_variables_with_horovods_ranks(tmp_path):
    result = run_mpt("launch", "--backend", "horovod", "--gpus", "2", "--master-port", "auto",
                     "tests/cluster/env_join_worker.py", str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["env"] == {"RANK": rank, "WORLD_SIZE": 2, "LOCAL_RANK": rank,
                               "LOCAL_WORLD_SIZE": 2, "GROUP_RANK": 0}
        assert seen["torch"] == [rank, 2, 3.0]  # one job of 2, not two of 1
        assert seen["horovod"] == [rank, 2, rank, 0, 3.0]
