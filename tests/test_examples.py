"""The examples as users run them: real 2-process jobs through `mpt launch`.

The digits job is `make demo`'s and must reach its accuracy. The ImageFolder ResNet and the GPT
run a few steps of a tiny configuration under every backend in bf16-mixed: what is tested is
that each goes end to end (set-up, steps, evaluation, the final report) on each backend; what
they reach in full runs is measured in docs/examples.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_mpt

EXAMPLES = Path(__file__).parents[1] / "examples"
BACKENDS = ("ddp", "apex", "horovod", "deepspeed")
TINY = {  # a few seconds of work per run; the process start-up is most of each test
    "imagenet": ("--classes", "4", "--per-class", "8", "--image-size", "16", "--batch-size",
                 "4", "--warmup-steps", "1"),
    "gpt": ("--layers", "2", "--heads", "2", "--embed", "32", "--block", "32", "--batch-size",
            "4", "--eval-every", "3", "--eval-batches", "1", "--warmup-steps", "1",
            "--sample", "8"),
}


def launch(port: int, *args: str, backend: str = "ddp"):
    zero = ("--zero-stage", "2") if backend == "deepspeed" else ()  # ZeRO, as the docs show
    return run_mpt("launch", "--gpus", "2", "--backend", backend, *zero, "--precision",
                   "bf16-mixed", "--master-port", str(port), *args, timeout=300)


def test_digits_example_reaches_95_percent_on_two_processes_in_bf16(tmp_path, free_port):
    ckpt = tmp_path / "digits"
    result = launch(free_port, str(EXAMPLES / "digits.py"), "--save", str(ckpt))
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 2: backend ddp, precision bf16-mixed" in result.stdout
    accuracy = float(re.search(r"held-out accuracy: ([\d.]+)%", result.stdout).group(1))
    assert accuracy >= 95.0, result.stdout
    assert (ckpt / "latest").is_file()


FAST = {("imagenet", "ddp"), ("gpt", "deepspeed")}
"""The pairs `make test` runs (one resumes); `make conformance` runs all 8 (marked slow)."""


@pytest.mark.parametrize(("example", "backend"), [
    pytest.param(example, backend, id=f"{example}-{backend}",
                 marks=() if (example, backend) in FAST else pytest.mark.slow)
    for example in ("imagenet", "gpt") for backend in BACKENDS])
def test_example_runs_three_steps_under_every_backend_in_bf16(example, backend, tmp_path,
                                                              free_port):
    args = [str(EXAMPLES / f"{example}.py"), *TINY[example], "--save", str(tmp_path / "ckpt")]
    if example == "imagenet":
        args += ["--generate-dir", str(tmp_path)]
    resumes = example == "imagenet" and backend == "ddp"  # one case resumes: 2 steps, then 3
    if resumes:
        first = launch(free_port, *args, "--steps", "2", "--eval-every", "2", backend=backend)
        assert first.returncode == 0, first.stdout + first.stderr
    result = launch(free_port, *args, "--steps", "3", backend=backend)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"rank 0 of 2: backend {backend}, precision bf16-mixed" in result.stdout
    assert "after 3 steps" in result.stdout, result.stdout
    assert (tmp_path / "ckpt" / "latest").is_file()
    if resumes:
        assert "resumed from" in result.stdout and "at step 2" in result.stdout, result.stdout


@pytest.mark.slow
def test_gpt_cut_into_two_pipeline_stages_trains_as_one_process(tmp_path, free_port):
    """examples/gpt.py's blocks over 2 ranks (its embedding and output layer share weights on
    the first and last stage) reach the one-process run's train and val losses (fp32), and
    sample the same text."""
    args = [str(EXAMPLES / "gpt.py"), *TINY["gpt"], "--sample", "24", "--steps", "3"]
    reports = []
    for gpus, flags in ((1, ()), (2, ("--pipeline-stages", "2"))):
        result = run_mpt("launch", "--gpus", str(gpus), *flags, "--master-port",
                         str(free_port), *args, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        # rank 0's lines, without the rank prefix of a launch of several ranks
        lines = [re.sub(r"^\[rank0\]: ", "", line) for line in result.stdout.splitlines()]
        sampled = next(line for line in lines if line.startswith("The "))
        reports.append([re.sub(r"\s+[\d,]+ tokens/s.*", "", line)
                        for line in lines if "val loss" in line] + [sampled])
    assert reports[0] and reports[0] == reports[1], reports
