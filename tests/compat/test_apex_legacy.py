"""The Apex-era example runs unmodified but for its import: under `mpt launch --gpus 2`, then
resumed through its own ``--gpus`` flag (mp.spawn), its amp checkpoint round-tripping."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from conftest import find_free_port, run_mpt

EXAMPLE = Path(__file__).parents[2] / "examples" / "apex_legacy.py"


def test_legacy_apex_script_trains_under_mpt_launch_and_resumes_its_amp_checkpoint(
        tmp_path, free_port):
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), str(EXAMPLE),
                     "--epochs", "4", "--opt-level", "O2", "--save", str(first))
    assert result.returncode == 0, result.stderr
    assert "opt_level O2" in result.stdout
    accuracy = float(re.search(r"Accuracy: ([\d.]+)%", result.stdout).group(1))
    assert accuracy >= 90.0, result.stdout
    assert "Master weights dtype: torch.float32, model weights dtype: torch.float16" in (
        result.stdout)
    saved = torch.load(first)
    assert set(saved["amp"]["loss_scaler0"]) == {"loss_scale", "unskipped"}

    # Resume with the script's own launcher (mp.spawn over --gpus); no epochs left to train,
    # so what it saves again must be what it loaded.
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(MASTER_PORT=str(find_free_port()), OMP_NUM_THREADS="1")
    resumed = subprocess.run([sys.executable, str(EXAMPLE), "--nodes", "1", "--gpus", "2",
                              "--nr", "0", "--epochs", "4", "--resume", str(first), "--save",
                              str(second)], capture_output=True, text=True, timeout=120, env=env)
    assert resumed.returncode == 0, resumed.stderr
    scale = saved["amp"]["loss_scaler0"]["loss_scale"]
    assert f"Resumed at epoch 4, loss scale {scale}" in resumed.stdout
    again = torch.load(second)
    assert again["amp"] == saved["amp"]
    for name, tensor in saved["model"].items():
        assert torch.equal(again["model"][name], tensor), name
    torch.testing.assert_close(again["optimizer"], saved["optimizer"], rtol=0, atol=0)
