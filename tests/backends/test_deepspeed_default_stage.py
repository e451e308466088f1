"""Where no ZeRO stage is chosen, deepspeed takes stage 1, which trains several models too (a
GAN: each model an engine of its own), and says so once; a chosen stage stays the user's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from conftest import run_mpt, worker
from gan_common import reference

from mpt.backends.deepspeed_config import DEFAULT_STAGE, build_config, chosen_stage
from mpt.precision import LossScaleConfig

pytest.importorskip("deepspeed", reason="`make` installs deepspeed into .venv")


def stage_of(user: dict, stage: int | None) -> int:
    config = build_config(user, stage=stage, offload=frozenset(), mode=None,
                          loss_scale=LossScaleConfig(), accumulate=1, world_size=2)
    return config["zero_optimization"]["stage"]


def test_the_flag_or_the_config_chooses_else_stage_1():
    assert DEFAULT_STAGE == 1 and stage_of({}, None) == 1 and chosen_stage({}, None) is None
    assert stage_of({}, 0) == 0 and chosen_stage({}, 0) == 0
    assert stage_of({"zero_optimization": {"stage": 0}}, None) == 0
    assert chosen_stage({"zero_optimization": {"stage": 2}}, None) == 2
    assert chosen_stage({"zero_optimization": {"overlap_comm": True}}, None) is None


def test_a_gan_without_a_chosen_stage_trains_at_stage_1_and_says_so_once(tmp_path, free_port):
    steps, batch = 3, 8
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--backend",
                     "deepspeed", worker("gan.py"), str(tmp_path), str(steps), str(batch),
                     timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    said = "mpt: deepspeed trains several models at ZeRO stage 1, taken because no --zero-stage"
    assert (result.stdout + result.stderr).count(said) == 1, result.stderr[-3000:]
    want = reference(steps, batch)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ("G", "D"):
            for mine, theirs in zip(got["trained"][name], want[name], strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
