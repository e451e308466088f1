"""Each cluster recipe runs `mpt launch` with its node's rank: schedulers and `mpt` are faked."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import run_mpt

ROOT = Path(__file__).parents[2]


def fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def test_slurm_recipe_launches_each_node_with_its_rank(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake(bin_dir, "scontrol", f'echo "$@" >> {tmp_path}/scontrol; printf "gpu-a01\\ngpu-a02\\n"')
    # srun on the second node: drop srun's own options, set that task's SLURM_NODEID, run.
    fake(bin_dir, "srun", 'shift; SLURM_NODEID=1 exec "$@"')
    fake(bin_dir, "mpt", f'printf "%s\\n" "$@" > {tmp_path}/args')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "mpt"}
    subprocess.run(["bash", str(ROOT / "launchers/slurm.sbatch"), "examples/digits.py",
                    "--epochs", "3"], env=env, check=True, cwd=ROOT)
    args = (tmp_path / "args").read_text().splitlines()
    assert args == ["launch", "--nodes", "2", "--gpus", "2", "--nr", "1",
                    "--master-addr", "gpu-a01", "--master-port", "14242", "--backend", "ddp",
                    "--precision", "bf16-mixed", "--checkpoint-dir", "checkpoints/mpt",
                    "examples/digits.py", "--epochs", "3"]
    assert "requeue" not in (tmp_path / "scontrol").read_text()
    # and the real `mpt launch` accepts exactly that command line
    result = run_mpt(*args[:-3], "--dry-run", str(ROOT / "examples/digits.py"))
    assert result.returncode == 0, result.stderr
    assert "gpu-a01:14242" in result.stdout


@pytest.mark.parametrize(("code", "requeued"), [(75, True), (3, False)])
def test_slurm_recipe_requeues_a_preempted_job_and_keeps_other_codes(tmp_path, code, requeued):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake(bin_dir, "scontrol", f'echo "$@" >> {tmp_path}/scontrol; printf "gpu-a01\\n"')
    fake(bin_dir, "srun", f"exit {code}")  # what `mpt launch` exits with on the node
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-a01", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "mpt"}
    result = subprocess.run(["bash", str(ROOT / "launchers/slurm.sbatch"), "train.py"], env=env,
                            cwd=ROOT)
    assert result.returncode == code
    assert ("requeue 4242" in (tmp_path / "scontrol").read_text()) == requeued


def fake_mpt(bin_dir: Path, out_dir: Path) -> None:
    """An `mpt` that records its arguments, one file per call (several hosts may call it)."""
    out_dir.mkdir()
    fake(bin_dir, "mpt", f'printf "%s\\n" "$@" > {out_dir}/$$')


def recorded(out_dir: Path) -> list[list[str]]:
    """The recorded `mpt` command lines, ordered by their --nr."""
    calls = [p.read_text().splitlines() for p in out_dir.iterdir()]
    return sorted(calls, key=lambda args: int(args[args.index("--nr") + 1]))


def node_command(nr: int, nodes: int, addr: str, port: str, *script: str) -> list[str]:
    return ["launch", "--nodes", str(nodes), "--gpus", "2", "--nr", str(nr), "--master-addr",
            addr, "--master-port", port, "--backend", "ddp", "--precision", "bf16-mixed",
            *script]


def run_recipe(tmp_path: Path, command: list[str], env: dict[str, str]) -> list[list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake_mpt(bin_dir, tmp_path / "calls")
    subprocess.run(command, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env},
                   check=True, cwd=ROOT, timeout=30)
    return recorded(tmp_path / "calls")


def test_lsf_recipe_launches_every_host_with_its_rank(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # blaunch -z HOST CMD...: run CMD "on" HOST (here), with a marker of where it ran.
    fake(bin_dir, "blaunch", f'echo "$2" >> {tmp_path}/hosts; shift 2; exec "$@"')
    calls = run_recipe(tmp_path, ["bash", str(ROOT / "launchers/lsf.bsub"), "train.py", "--x"],
                       {"LSB_MCPU_HOSTS": "hostA 1 hostB 1", "LSB_JOBID": "4242"})
    assert calls == [node_command(nr, 2, "hostA", "14242", "train.py", "--x") for nr in (0, 1)]
    assert sorted((tmp_path / "hosts").read_text().split()) == ["hostA", "hostB"]


def test_lsf_recipe_fails_with_the_failing_host_code(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake(bin_dir, "blaunch", 'shift 2; exec "$@"')
    # node 1 fails at once; node 0 would run for a minute unless the recipe stops it
    fake(bin_dir, "mpt", 'case " $* " in *" --nr 1 "*) exit 7;; *) exec sleep 60;; esac')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "LSB_MCPU_HOSTS": "hostA 1 hostB 1", "LSB_JOBID": "1"}
    result = subprocess.run(["bash", str(ROOT / "launchers/lsf.bsub"), "train.py"], env=env,
                            cwd=ROOT, timeout=30)
    assert result.returncode == 7


@pytest.mark.parametrize(("recipe", "starter", "rank_vars"), [
    ("mpirun.sh", "mpirun", {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}),
    ("horovodrun.sh", "horovodrun", {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}),
])
def test_mpirun_and_horovodrun_wrappers_start_mpt_launch_per_host(tmp_path, recipe, starter,
                                                                  rank_vars):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # The starter on the second host: record its own options, drop them, run the command there
    # with that rank's variables.
    sets = " ".join(f"{k}={v}" for k, v in rank_vars.items())
    fake(bin_dir, starter, f'printf "%s\\n" "$@" > {tmp_path}/starter\n'
         f'while [[ $1 != bash ]]; do shift; done\n{sets} exec "$@"')
    calls = run_recipe(tmp_path, ["bash", str(ROOT / "launchers" / recipe), "node1,node2",
                                  "train.py", "--epochs", "3"], {"MASTER_PORT": "29511"})
    assert calls == [node_command(1, 2, "node1", "29511", "train.py", "--epochs", "3")]
    starter_args = (tmp_path / "starter").read_text().splitlines()
    assert starter_args[:2] == ["-np", "2"]
    assert starter_args[3] == ("node1,node2" if starter == "mpirun" else "node1:1,node2:1")


def test_pytorchjob_manifest_runs_mpt_launch_with_the_pod_rank(tmp_path):
    yaml = pytest.importorskip("yaml")  # pyyaml is a dependency of mpt; never skipped there
    job = yaml.safe_load((ROOT / "launchers/pytorchjob.yaml").read_text())
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert job["kind"] == "PyTorchJob" and replicas["Master"]["replicas"] == 1
    nodes = replicas["Master"]["replicas"] + replicas["Worker"]["replicas"]
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    # What the operator sets in the second pod; run the container's command as it would.
    calls = run_recipe(tmp_path, [*container["command"], *container["args"]],
                       {"RANK": "1", "MASTER_ADDR": "mpt-digits-master-0", "MASTER_PORT": "23456"})
    assert calls == [node_command(1, nodes, "mpt-digits-master-0", "23456",
                                  "examples/digits.py")]
