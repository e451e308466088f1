"""`make gpu-check` where there is no GPU to check (this machine): one line and nothing else; a
GPU the driver lists but this torch cannot use: one line naming the driver and the build. The
parts of the GPU path that need no GPU (what it plans, how it reads an example's figures) run
here too."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import pid_alive, run_mpt, wait_for

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without GPU")


def run_check(tmp_path: Path, smi_output: str) -> subprocess.CompletedProcess[str]:
    """benchmarks/gpu_check.py with an ``nvidia-smi`` that lists ``smi_output`` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{smi_output}'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--report", str(tmp_path / "report.json")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})


def test_without_a_gpu_it_says_so_in_one_line_and_does_nothing_else(tmp_path):
    result = run_check(tmp_path, "")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and result.stderr == "", result
    assert result.stdout.startswith(f"gpu-check: no CUDA GPU here (torch {torch.__version__}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # no report, no runs/


def test_a_gpu_this_torch_cannot_use_is_one_line_naming_driver_and_build(tmp_path):
    result = run_check(tmp_path, "NVIDIA H100 80GB HBM3, 470.57.02\\n")
    assert result.returncode == 1
    assert result.stdout.count("\n") == 1 and result.stderr == "", result
    line = result.stdout
    assert line.startswith("gpu-check: NVIDIA H100 80GB HBM3 with driver 470.57.02 is visible but "
                           f"torch {torch.__version__}"), line
    assert (f" built for CUDA {torch.version.cuda} cannot use it (" if torch.version.cuda
            else "a CPU build, cannot use it") in line


def test_the_plan_names_every_check_and_why_one_cannot_run(tmp_path):
    checks = {name: (command, reason) for name, command, _, reason in gpu_check.plan(tmp_path, 1)}
    assert {"grid", "nccl", "fsdp-offload", "horovod-cuda", "pytest-gpu"} <= set(checks)
    assert {f"example-{name}" for name in gpu_check.EXAMPLES} <= set(checks)
    assert "needs 2" in checks["nccl"][1]
    assert "O3" in " ".join(checks["grid"][0]) and "fp16-mixed" in " ".join(checks["grid"][0])
    for name, script in (("fsdp-offload", "--fsdp-cpu-offload"), ("example-gpt", "gpt.py")):
        assert any(script in part for part in checks[name][0])


def test_an_examples_figures_come_from_its_metrics(tmp_path, free_port):
    """A real short run (here on CPU): samples/s read back; no MFU where it counts no FLOPs."""
    run_dir = tmp_path / "digits"
    result = run_mpt("launch", "--master-port", str(free_port), "--quiet", "--run-dir",
                     str(run_dir), str(ROOT / "examples" / "digits.py"), "--steps", "20")
    assert result.returncode == 0, result.stderr
    figures = gpu_check.example_figures(run_dir, "samples", peak_tflops=989.0)
    assert figures["samples_per_s"] > 0 and figures["mfu"] is None
    assert figures["mfu_note"] == "the example counts no FLOPs"
    assert gpu_check.datasheet_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_check.datasheet_tflops("Some Future GPU") is None


def test_a_check_past_its_timeout_is_stopped_with_everything_it_started(tmp_path):
    marker = tmp_path / "child.pid"
    command = ["bash", "-c", f"sleep 60 & echo $! > {marker}; echo started; wait"]
    result = gpu_check.run("slow", command, timeout=2, env=dict(os.environ))
    assert result.status == "timeout" and result.tail.startswith("started")
    child = int(marker.read_text())
    assert wait_for(lambda: not pid_alive(child), 5), "the check's own child outlived its timeout"
