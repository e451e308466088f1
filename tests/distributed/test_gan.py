"""Several models and optimizers in one run: a DCGAN-shaped loop (two optimizers, three losses,
the generator's loss through the discriminator) on 1 and 2 real gloo ranks under every backend
gives the parameters of the same loop in plain torch on one process over the whole batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from conftest import run_mpt, worker
from gan_common import reference

STEPS, BATCH = 5, 8
BACKENDS = [("ddp", []), ("apex", []), ("horovod", []), ("fsdp", []),
            *[("deepspeed", ["--zero-stage", str(stage)]) for stage in (1,)]]


@pytest.mark.parametrize("gpus", [pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.parametrize(("backend", "options"), BACKENDS,
                         ids=[f"{b}{o[-1] if o else ''}" for b, o in BACKENDS])
def test_a_dcgan_loop_trains_like_plain_torch(tmp_path, free_port, backend, options, gpus):
    result = run_mpt("launch", "--gpus", str(gpus), "--master-port", str(free_port),
                     "--backend", backend, *options, worker("gan.py"), str(tmp_path),
                     str(STEPS), str(BATCH), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    want = reference(STEPS, BATCH)
    for rank in range(gpus):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["stepped"] == [True] * (2 * STEPS)
        assert got["global_step"] == STEPS  # iterations, not optimizer calls
        for name in ("G", "D"):
            for mine, theirs in zip(got["trained"][name], want[name], strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
            for after, before in zip(got["restored"][name], got["trained"][name], strict=True):
                assert torch.equal(after, before)  # save, spoil, load: bit for bit


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 2,
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_deepspeed_refuses_several_models_at_the_stages_that_would_mix_their_gradients(
        tmp_path, free_port, stage):
    result = run_mpt("launch", "--gpus", "1", "--master-port", str(free_port), "--backend",
                     "deepspeed", "--zero-stage", str(stage), worker("gan.py"), str(tmp_path),
                     "1", "4", timeout=240)
    assert result.returncode != 0
    assert (f"--zero-stage={stage} is invalid: DeepSpeed keeps a model's gradients apart only "
            "at stage 1 when a script trains several models. Fix: use --zero-stage 1"
            ) in result.stderr
