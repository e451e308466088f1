"""The Horovod variables a worker of a plain `mpt launch` gets, and the port node 0 needs.

That a Horovod script really joins is shown by tests/upstream (Horovod's MNIST unchanged)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import find_free_port, worker

from mpt.backends import get_backend
from mpt.environments import World
from mpt.environments.settings import HOROVOD_RENDEZVOUS, horovod_rendezvous
from mpt.errors import UsageError
from mpt.launchers import LaunchSpec
from mpt.launchers.horovod_join import HorovodRendezvous, check_port, join_env
from mpt.run_config import RunConfig

pytest.importorskip("horovod.runner.http.http_server")


def test_a_worker_of_two_nodes_of_two_gets_horovods_variables():
    world = World(nodes=2, gpus=2, nr=1, local_rank=1, source="torchelastic")
    env = join_env(world, "node0.example:29501")
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "node0.example"
    assert env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "29501"
    assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"], env["HOROVOD_LOCAL_RANK"],
            env["HOROVOD_LOCAL_SIZE"], env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == (
        "3", "4", "1", "2", "1", "2")
    assert env["HOROVOD_HOSTNAME"] == "node1" and env["HOROVOD_CONTROLLER"] == "gloo"
    # horovodrun's own workers keep the variables it set
    assert horovod_rendezvous({HOROVOD_RENDEZVOUS: "h:1", "HOROVOD_RANK": "0"}) is None
    assert horovod_rendezvous({HOROVOD_RENDEZVOUS: "h:1"}) == "h:1"


def test_node0_serves_on_master_port_plus_one_and_refuses_it_busy():
    port = find_free_port()
    spec = LaunchSpec(script=Path(worker("report_world.py")), nodes=2, gpus=1,
                      master_port=port - 1)
    rendezvous = HorovodRendezvous.start(spec)
    try:
        assert rendezvous.env() == {HOROVOD_RENDEZVOUS: f"127.0.0.1:{port}"}
        with pytest.raises(UsageError, match=r"--master-port.*hvd.init\(\)"):
            check_port(spec)  # the server itself holds it now
    finally:
        rendezvous.stop()
    check_port(spec)
    other = HorovodRendezvous.start(LaunchSpec(script=spec.script, nodes=2, gpus=1, nr=1,
                                               master_port=port - 1))
    assert other.server is None and other.env()[HOROVOD_RENDEZVOUS].endswith(f":{port}")
    one = HorovodRendezvous.start(LaunchSpec(script=spec.script, gpus=2))  # a free port
    one.stop()
    assert int(one.address.rpartition(":")[2]) > 0


def test_horovods_cycle_time_reaches_the_workers_as_horovodrun_would_set_it():
    spec = LaunchSpec(script=Path(worker("report_world.py")), gpus=2, run=RunConfig(
        backend="horovod", backend_options={"cycle_time_ms": "2.5"}))
    assert spec.worker_env()["HOROVOD_CYCLE_TIME"] == "2.5"
    assert "HOROVOD_CYCLE_TIME" not in LaunchSpec(script=spec.script, gpus=2).worker_env()


def test_restarts_under_horovod_are_refused_before_start():
    script = Path(worker("report_world.py"))
    with pytest.raises(UsageError, match=r"--max-restarts=2 is invalid: Horovod's rendezvous"):
        get_backend("horovod").check_launch(LaunchSpec(script=script, max_restarts=2,
                                                       run=RunConfig(backend="horovod")))
    get_backend("ddp").check_launch(LaunchSpec(script=script, max_restarts=2))  # ddp restarts


def test_horovod_under_a_launcher_it_cannot_join_refuses_instead_of_two_separate_jobs(
        tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import mpt\nmpt.Runtime(backend='horovod')\nprint('trained alone')\n")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(find_free_port()), str(script)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0 and "trained alone" not in result.stdout
    # Both ranks refuse; whichever does first gets the other stopped before it may print.
    assert re.search(r"--backend=horovod is invalid: Horovod sees rank 0 of 1, but torchelastic "
                     r"started rank [01] of 2: Horovod cannot join this launcher's job\. Fix: "
                     r"start it with `mpt launch` \(any backend\), `mpt horovodrun` or "
                     r"horovodrun", result.stderr)
