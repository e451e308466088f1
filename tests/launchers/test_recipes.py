"""The SLURM recipe runs `mpt launch` with the node's rank: srun and scontrol are faked."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import run_mpt

ROOT = Path(__file__).parents[2]


def fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def test_slurm_recipe_launches_each_node_with_its_rank(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake(bin_dir, "scontrol", 'printf "gpu-a01\\ngpu-a02\\n"')
    # srun on the second node: drop srun's own options, set that task's SLURM_NODEID, run.
    fake(bin_dir, "srun", 'shift; SLURM_NODEID=1 exec "$@"')
    fake(bin_dir, "mpt", f'printf "%s\\n" "$@" > {tmp_path}/args')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_NNODES": "2"}
    subprocess.run(["bash", str(ROOT / "launchers/slurm.sbatch"), "examples/digits.py",
                    "--epochs", "3"], env=env, check=True, cwd=ROOT)
    args = (tmp_path / "args").read_text().splitlines()
    assert args == ["launch", "--nodes", "2", "--gpus", "2", "--nr", "1",
                    "--master-addr", "gpu-a01", "--master-port", "14242", "--backend", "ddp",
                    "--precision", "bf16-mixed", "examples/digits.py", "--epochs", "3"]
    # and the real `mpt launch` accepts exactly that command line
    result = run_mpt(*args[:-3], "--dry-run", str(ROOT / "examples/digits.py"))
    assert result.returncode == 0, result.stderr
    assert "gpu-a01:14242" in result.stdout
