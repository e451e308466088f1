"""`mpt checkpoint convert` of a real DeepSpeed ZeRO-2 checkpoint written by 2 ranks.

One raw DeepSpeed job (workers/ckpt_deepspeed_raw.py: no mpt.Runtime, `engine.save_checkpoint`
as a DeepSpeed user writes it; ~15 s), then the conversion and `rt.load` in this process.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import make_model
from conftest import find_free_port, run_mpt, worker

import mpt


@pytest.fixture(scope="module")
def zero_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero")
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))}
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(find_free_port()),
                     worker("ckpt_deepspeed_raw.py"), str(out), timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (out / "ds" / "global_step3").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # both ranks' shards: a real merge
    return out




def test_a_zero2_checkpoint_converts_and_loads_with_rt_load(zero_dir, tmp_path, run_cli):
    result = run_cli("checkpoint", "convert", str(zero_dir / "ds"), str(tmp_path / "mpt"))
    assert result.returncode == 0, result.stderr
    assert "4 tensors" in result.stdout and "optimizer state not converted" in result.stdout
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # put back as it was
    rt = mpt.Runtime(env={})
    model = make_model()  # seeded: the same start as the DeepSpeed job's, before its 3 steps
    model, _ = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    assert rt.load(tmp_path / "mpt")["step"] == 3  # from the tag, global_step3
    expected = torch.load(zero_dir / "expected.pt", weights_only=True)
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        assert torch.equal(got[name], want), name  # fp32 masters, bit for bit
    assert not torch.equal(got["0.weight"], make_model().state_dict()["0.weight"])  # trained


class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_planted_in_a_zero_checkpoint_is_never_run(zero_dir, tmp_path, run_cli):
    spoiled = tmp_path / "ds"
    shutil.copytree(zero_dir / "ds", spoiled)
    marker = tmp_path / "pwned"
    target = spoiled / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    # a zip-format torch file, as DeepSpeed writes: DeepSpeed's own reader would run it
    torch.save({"optimizer_state_dict": Planted(marker)}, target)
    result = run_cli("checkpoint", "convert", str(spoiled), str(tmp_path / "x"))
    assert result.returncode == 2 and "Weights only load failed" in result.stderr
    assert not marker.exists() and not (tmp_path / "x").exists()


def test_a_directory_that_is_no_zero_checkpoint_is_one_usage_error(tmp_path, run_cli):
    result = run_cli("checkpoint", "convert", str(tmp_path), str(tmp_path / "x"))
    assert result.returncode == 2 and "not a DeepSpeed checkpoint" in result.stderr
