"""examples/pix2pix.py, the two-model example, for a few steps on 2 ranks under every backend;
under ddp also stopped and resumed from its checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_mpt

EXAMPLE = Path(__file__).parents[1] / "examples" / "pix2pix.py"
# Under every backend the two-model loop itself is tested against plain torch (distributed/
# test_gan.py); here ddp runs in `make test`, the other backends in `make conformance`.
CASES = [("ddp", "bf16-mixed", []),
         *[pytest.param(*case, marks=pytest.mark.slow, id=case[0]) for case in (
             ("apex", "fp16-mixed", []), ("horovod", "bf16-mixed", []),
             ("deepspeed", "bf16-mixed", ["--zero-stage", "1"]))]]


@pytest.mark.parametrize(("backend", "precision", "options"), CASES)
def test_pix2pix_trains_and_resumes_on_two_ranks(tmp_path, free_port, backend, precision,
                                                 options):
    def launch(steps: int):
        result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--backend",
                         backend, "--precision", precision, *options, "--checkpoint-dir",
                         str(tmp_path / "ckpt"), str(EXAMPLE), "--steps", str(steps),
                         "--images", "64", "--batch-size", "8", timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    first = launch(3)
    assert f"backend {backend}, precision {precision}, from step 0" in first
    assert re.search(r"step +3 +D [\d.]+ +G adv [\d.]+ +L1 [\d.]+", first), first
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-000000003"
    if backend == "ddp":  # a rerun goes on from the checkpoint, both models and optimizers
        again = launch(5)
        assert "from step 3" in again and re.search(r"step +5 +D", again), again
    assert re.search(r"held-out L1: [\d.]+", first)
