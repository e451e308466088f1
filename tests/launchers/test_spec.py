"""LaunchSpec: validation that needs no process, and the torchrun config it becomes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpt.errors import UsageError
from mpt.launchers import LaunchSpec
from mpt.launchers.elastic import torch_launch_config, worker_env
from mpt.run_config import RunConfig

SCRIPT = Path(__file__)


def test_more_gpus_than_visible_is_refused(free_port):
    spec = LaunchSpec(script=SCRIPT, gpus=4, master_port=free_port)
    with pytest.raises(UsageError, match=r"^--gpus=4 is invalid: this node has only 2 visible"):
        spec.check_machine(cuda_devices=2)
    spec.check_machine(cuda_devices=0)  # CPU processes: any number


def test_spec_becomes_a_static_rendezvous_with_the_node_rank():
    spec = LaunchSpec(script=SCRIPT, nodes=2, gpus=3, nr=1, master_addr="10.0.0.1",
                      master_port=1234, max_restarts=2, log_dir=Path("logs"))
    config = torch_launch_config(spec)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 3)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "10.0.0.1:1234")
    assert config.rdzv_configs["rank"] == 1 and config.max_restarts == 2
    assert config.logs_specs.root_log_dir == "logs"
    assert spec.world.world_size == 6


def test_workers_inherit_the_settings():
    run = RunConfig(backend="ddp", precision="fp16-mixed", loss_scale="128", accumulate=2)
    env = worker_env(LaunchSpec(script=SCRIPT, gpus=2, run=run), failure_dir="/tmp/notes")
    assert RunConfig.from_env(env) == run  # one variable carries them all
    spelled = json.loads(json.dumps(RunConfig().values()))  # JSON's lists for tuples
    assert json.loads(env["MPT_RUN_CONFIG"]) == {**spelled, "backend": "ddp",
                                                 "precision": "fp16-mixed", "loss_scale": "128",
                                                 "accumulate": 2}
    assert env["MPT_LAUNCHER_PID"].isdigit()
    assert env["MPT_FAILURE_DIR"] == "/tmp/notes"


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"max_restarts": -1}, "--max-restarts"), ({"nodes": 0}, "--nodes"),
    ({"master_port": 0}, "--master-port"), ({"script": Path("nope.py")}, "SCRIPT"),
])
def test_invalid_specs_name_their_argument(kwargs, argument):
    with pytest.raises(UsageError, match=f"^{argument}="):
        LaunchSpec(**{"script": SCRIPT, **kwargs})


def test_opt_level_overrides_reach_the_workers_runtime():
    import torch
    from torch import nn

    import mpt

    spec = LaunchSpec(script=SCRIPT, run=RunConfig(
        precision="O2", precision_options={"keep_batchnorm_fp32": "no"}))
    rt = mpt.Runtime(env=spec.worker_env())  # what a worker of this launch reads
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # O2 keeps batchnorm in fp32 unless told otherwise: here it was told.
    assert model[0].weight.dtype == model[1].weight.dtype == torch.float16
    with pytest.raises(UsageError, match="master_weights"):
        LaunchSpec(script=SCRIPT, run=RunConfig(precision="fp32",
                                                precision_options={"master_weights": True}))
