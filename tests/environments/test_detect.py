"""Environment detection: each launcher's variables, read from a plain dict, give the right World.

No process is started: detection is a pure function of the environment mapping.
"""

from __future__ import annotations

import pytest

from mpt.environments import SOURCES, World, detect_world, first_host
from mpt.errors import UsageError


def torchrun(rank: int, local_rank: int, world_size: int, local_world_size: int,
             group_rank: int | None = None, **extra: str) -> dict[str, str]:
    """The variables torchrun gives one worker."""
    env = {"TORCHELASTIC_RUN_ID": "none", "RANK": str(rank), "LOCAL_RANK": str(local_rank),
           "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(local_world_size),
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    if group_rank is not None:
        env["GROUP_RANK"] = str(group_rank)
    return env | extra


def slurm(procid: int, localid: int, ntasks: int, nnodes: int, nodeid: int,
          **extra: str) -> dict[str, str]:
    """The variables srun gives one task of job 123456 on node[01-04]."""
    return {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
            "SLURM_NTASKS": str(ntasks), "SLURM_NNODES": str(nnodes), "SLURM_NODEID": str(nodeid),
            "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "train",
            "SLURM_JOB_NODELIST": "node[01-04]"} | extra


def horovod(rank: int, size: int, local_rank: int, local_size: int, cross_rank: int,
            cross_size: int, **extra: str) -> dict[str, str]:
    """The variables horovodrun (gloo) gives one process."""
    return {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
            "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(local_size),
            "HOROVOD_CROSS_RANK": str(cross_rank), "HOROVOD_CROSS_SIZE": str(cross_size)} | extra


def openmpi(rank: int, size: int, local_rank: int, local_size: int, **extra: str) -> dict[str, str]:
    """The variables mpirun gives one process."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size)} | extra


def kubernetes(rank: int, world_size: int, **extra: str) -> dict[str, str]:
    """The variables the Kubeflow training operator gives a one-process pod."""
    return {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "RANK": str(rank),
            "WORLD_SIZE": str(world_size)} | extra


DEEPSPEED = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2",
             "CROSS_RANK": "1", "CROSS_SIZE": "2", "MASTER_ADDR": "worker-0",
             "MASTER_PORT": "29500"}
"""What the DeepSpeed launcher gives rank 3 of 2 nodes x 2 GPUs: no LOCAL_WORLD_SIZE, no run id."""


@pytest.mark.parametrize(("env", "expected"), [
    pytest.param(torchrun(1, 1, 2, 2, group_rank=0),
                 World(nodes=1, gpus=2, nr=0, local_rank=1, master_addr="10.0.0.1",
                       master_port=29400, source="torchelastic"), id="torchrun-one-node"),
    pytest.param(torchrun(5, 1, 8, 4, group_rank=1),
                 World(nodes=2, gpus=4, nr=1, local_rank=1, master_addr="10.0.0.1",
                       master_port=29400, source="torchelastic"), id="torchrun-two-nodes"),
    pytest.param({"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4"},
                 World(nodes=3, gpus=4, nr=1, local_rank=2, master_addr=None,
                       source="torchelastic"),
                 id="torchrun-vars-by-hand-no-master"),
    pytest.param(DEEPSPEED, World(nodes=2, gpus=2, nr=1, local_rank=1, master_addr="worker-0",
                                  source="torchelastic"), id="deepspeed-launcher"),
    pytest.param(slurm(2, 2, 4, 1, 0, SLURM_JOB_NODELIST="gpu07"),
                 World(nodes=1, gpus=4, nr=0, local_rank=2, master_addr="gpu07",
                       master_port=13456, source="slurm"), id="slurm-one-node"),
    pytest.param(slurm(6, 2, 8, 2, 1),
                 World(nodes=2, gpus=4, nr=1, local_rank=2, master_addr="node01",
                       master_port=13456, source="slurm"), id="slurm-two-nodes"),
    pytest.param(slurm(3, 1, 4, 2, 1, MASTER_ADDR="head", MASTER_PORT="1234"),
                 World(nodes=2, gpus=2, nr=1, local_rank=1, master_addr="head",
                       master_port=1234, source="slurm"), id="slurm-master-overrides"),
    pytest.param({"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
                  "SLURM_NNODES": "2"},
                 World(nodes=2, gpus=1, nr=1, master_addr=None, source="slurm"),
                 id="slurm-no-job-id-no-nodelist"),
    pytest.param(horovod(1, 2, 1, 2, 0, 1),
                 World(nodes=1, gpus=2, local_rank=1, source="horovod"), id="horovod-one-node"),
    pytest.param(horovod(3, 4, 1, 2, 1, 2),
                 World(nodes=2, gpus=2, nr=1, local_rank=1, master_addr=None, source="horovod"),
                 id="horovod-two-nodes"),
    pytest.param(openmpi(2, 4, 2, 4),
                 World(nodes=1, gpus=4, local_rank=2, source="openmpi"), id="openmpi-one-node"),
    pytest.param(openmpi(5, 6, 2, 3, MASTER_ADDR="head"),
                 World(nodes=2, gpus=3, nr=1, local_rank=2, master_addr="head", source="openmpi"),
                 id="openmpi-two-nodes"),
    pytest.param(kubernetes(2, 3),
                 World(nodes=3, gpus=1, nr=2, master_addr="job-master-0", master_port=23456,
                       source="kubernetes"), id="kubernetes-three-pods"),
    pytest.param(kubernetes(0, 1, PET_NPROC_PER_NODE="1"),
                 World(master_addr="job-master-0", master_port=23456, source="kubernetes"),
                 id="kubernetes-one-pod"),
    pytest.param({}, World(), id="local-empty"),
    pytest.param({"PATH": "/bin", "WORLD_SIZE": "1"}, World(), id="local-world-size-one"),
])
def test_rank_maths(env: dict[str, str], expected: World) -> None:
    world = detect_world(env)
    assert world == expected
    launcher_rank = next((int(env[n]) for n in ("RANK", "SLURM_PROCID", "HOROVOD_RANK",
                                                 "OMPI_COMM_WORLD_RANK") if n in env), 0)
    assert world.rank == launcher_rank


@pytest.mark.parametrize(("env", "source"), [
    pytest.param(torchrun(5, 1, 8, 4, group_rank=1) | slurm(1, 0, 2, 2, 1), "torchelastic",
                 id="torchrun-inside-slurm"),
    pytest.param(torchrun(1, 1, 2, 2) | openmpi(0, 1, 0, 1), "torchelastic",
                 id="torchrun-inside-mpirun"),
    pytest.param(openmpi(5, 8, 1, 4) | slurm(1, 0, 2, 2, 1), "openmpi",
                 id="mpirun-inside-sbatch"),
    pytest.param(horovod(1, 2, 1, 2, 0, 1) | openmpi(1, 2, 1, 2), "horovod",
                 id="horovod-before-openmpi"),
    pytest.param(horovod(1, 2, 1, 2, 0, 1) | slurm(0, 0, 1, 1, 0), "horovod",
                 id="horovodrun-inside-sbatch"),
    pytest.param(slurm(0, 0, 4, 1, 0, SLURM_JOB_NAME="bash"), "local", id="salloc-bash-shell"),
    pytest.param(slurm(0, 0, 4, 1, 0, SLURM_JOB_NAME="interactive"), "local",
                 id="salloc-interactive-shell"),
    pytest.param(slurm(0, 0, 2, 1, 0, SLURM_JOB_NAME="bash") | torchrun(1, 1, 2, 2), "torchelastic",
                 id="torchrun-in-salloc-shell"),
    pytest.param(kubernetes(1, 2) | {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "torchelastic",
                 id="torchrun-in-pytorchjob-pod"),
])
def test_detection_order(env: dict[str, str], source: str) -> None:
    assert detect_world(env).source == source


def test_sources_are_in_documented_order() -> None:
    assert [s.name for s in SOURCES] == ["torchelastic", "horovod", "openmpi", "slurm",
                                         "kubernetes"]


@pytest.mark.parametrize(("nodelist", "host"), [
    ("node[01-04,07],gpu-a[1-2]", "node01"),
    ("n1,n2", "n1"),
    ("host", "host"),
    ("node[007-010]", "node007"),
    ("node[10-12,01]", "node10"),
    ("gpu-a[1-2],node[01-04]", "gpu-a1"),
    ("rack[1-2]-node[01-04]", "rack1-node01"),
    ("node[3,5]", "node3"),
    ("login.cluster.org", "login.cluster.org"),
    (" node01 ", "node01"),
])
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "node[01-04", "node]01", "[", "node[a-b]", ",n1",
                                      "node[01-04]]"])
def test_first_host_refuses_malformed(nodelist: str) -> None:
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST"):
        first_host(nodelist)


def without(env: dict[str, str], name: str) -> dict[str, str]:
    """``env`` with one variable removed: a partially-set group."""
    return {k: v for k, v in env.items() if k != name}


@pytest.mark.parametrize(("env", "variable", "fix"), [
    pytest.param(slurm(0, 0, 4, 1, 0, SLURM_PROCID="abc"), "SLURM_PROCID", "", id="not-integer"),
    pytest.param(slurm(1, 0, 4, 2, 1), "SLURM_PROCID", "--distribution=block",
                 id="slurm-cyclic-distribution"),
    pytest.param(slurm(1, 1, 7, 2, 0), "SLURM_NTASKS", "same number", id="slurm-uneven-nodes"),
    pytest.param(slurm(0, 0, 4, 0, 0), "SLURM_NNODES", "", id="slurm-zero-nodes"),
    pytest.param(without(slurm(0, 0, 4, 1, 0), "SLURM_LOCALID"), "SLURM_LOCALID", "unset",
                 id="slurm-missing-localid"),
    pytest.param(without(slurm(0, 0, 4, 1, 0), "SLURM_NNODES"), "SLURM_NNODES", "unset",
                 id="slurm-missing-nnodes"),
    pytest.param(slurm(0, 0, 4, 1, 0, SLURM_JOB_ID="12a"), "SLURM_JOB_ID", "", id="slurm-job-id"),
    pytest.param(slurm(0, 0, 4, 2, 0, SLURM_JOB_NODELIST="node[01-"), "SLURM_JOB_NODELIST",
                 "MASTER_ADDR", id="slurm-bad-nodelist"),
    pytest.param(slurm(0, 0, 4, 2, 2), "SLURM_NODEID", "", id="slurm-node-id-too-big"),
    pytest.param(torchrun(1, 1, 6, 4), "WORLD_SIZE", "same number", id="torchrun-uneven"),
    pytest.param(without(torchrun(1, 1, 2, 2), "LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE", "unset",
                 id="torchrun-missing-local-world-size"),
    pytest.param(torchrun(3, 4, 8, 4), "LOCAL_RANK", "", id="torchrun-local-rank-too-big"),
    pytest.param(torchrun(8, 0, 8, 4), "RANK", "", id="torchrun-rank-too-big"),
    pytest.param(torchrun(5, 1, 8, 4, group_rank=0), "RANK", "--nproc-per-node",
                 id="torchrun-group-rank-disagrees"),
    pytest.param(torchrun(0, 0, 2, 2, MASTER_PORT="70000"), "MASTER_PORT", "", id="port-range"),
    pytest.param(torchrun(0, 0, 2, 2, MASTER_PORT="http"), "MASTER_PORT", "", id="port-text"),
    pytest.param(without(horovod(0, 2, 0, 2, 0, 1), "HOROVOD_SIZE"), "HOROVOD_SIZE", "unset",
                 id="horovod-missing-size"),
    pytest.param(horovod(0, 6, 0, 2, 0, 2), "HOROVOD_SIZE", "same number",
                 id="horovod-size-not-product"),
    pytest.param(openmpi(1, 4, 0, 2), "OMPI_COMM_WORLD_RANK", "--map-by slot",
                 id="openmpi-map-by-node"),
    pytest.param(openmpi(0, 4, 0, 0), "OMPI_COMM_WORLD_LOCAL_SIZE", "", id="openmpi-zero-local"),
    pytest.param(kubernetes(3, 3), "RANK", "", id="kubernetes-rank-too-big"),
    pytest.param(kubernetes(0, 2, PET_NPROC_PER_NODE="4"), "PET_NPROC_PER_NODE", "torchrun",
                 id="kubernetes-pod-meant-for-torchrun"),
    pytest.param({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, "WORLD_SIZE",
                 "LOCAL_WORLD_SIZE", id="partial-torchrun-vars"),
])
def test_invalid_environment_names_the_variable(env: dict[str, str], variable: str,
                                                fix: str) -> None:
    with pytest.raises(UsageError) as caught:
        detect_world(env)
    message = str(caught.value)
    assert message.startswith(f"{variable}="), message
    assert caught.value.argument == variable
    assert fix in caught.value.hint
    assert "\n" not in message
