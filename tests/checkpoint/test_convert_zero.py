"""`mpt checkpoint convert` of a real DeepSpeed ZeRO-2 checkpoint written by 2 ranks.

One plain DeepSpeed job (workers/foreign_deepspeed.py: no mpt.Runtime, AdamW, a warm-up
schedule, `engine.save_checkpoint` after step 3 as a DeepSpeed user writes it, then on to step
8; ~10 s), then the conversion and an mpt run in this process (ddp, 1 process) that loads it
and goes on: it must follow DeepSpeed's own continuation. The same at other stages, world sizes
and backends: test_foreign_resume.py (slow).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import make_model
from conftest import find_free_port, run_mpt, worker
from foreign_common import continue_in_mpt, make_adamw, make_warmup
from torch import nn

import mpt
from mpt.errors import CheckpointError

SAVE_AT, STEPS = 3, 8


@pytest.fixture(scope="module")
def zero_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero")
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))}
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(find_free_port()),
                     worker("foreign_deepspeed.py"), str(out), "2", str(SAVE_AT), str(STEPS),
                     timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (out / "ds" / "global_step3").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # both ranks' shards: a real merge
    return out


def resume(path: Path, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW
           ) -> tuple[mpt.Runtime, nn.Module, torch.optim.Optimizer, object, dict]:
    """An mpt run of the plain script's model, optimizer and schedule that loads ``path``."""
    rt = mpt.Runtime(env={})
    model = make_model()  # seeded: the same start as the DeepSpeed job's, before its 3 steps
    made = make_adamw(model) if optimizer is torch.optim.AdamW else optimizer(
        model.parameters(), lr=0.1)
    model, opt = rt.setup(model, made)
    scheduler = make_warmup(opt)
    return rt, model, opt, scheduler, rt.load(path, scheduler=scheduler)


def test_a_zero2_checkpoint_converts_with_masters_moments_and_schedule(zero_dir, tmp_path,
                                                                       run_cli):
    result = run_cli("checkpoint", "convert", str(zero_dir / "ds"), str(tmp_path / "mpt"))
    assert result.returncode == 0, result.stderr
    assert "4 tensors, AdamW state of 4 parameters, LR scheduler" in result.stdout
    assert "not in it" in result.stdout and "RNG" in result.stdout  # said, not guessed
    rt, model, optimizer, scheduler, info = resume(tmp_path / "mpt")
    assert (info["step"], info["epoch"]) == (3, 0)  # from the script's client_state
    expected = torch.load(zero_dir / "expected.pt", weights_only=True)
    assert model.state_dict().keys() == expected["fp32"].keys()
    for name, want in expected["fp32"].items():
        assert torch.equal(model.state_dict()[name], want), name  # fp32 masters, bit for bit
    names = dict(zip(range(4), model.state_dict(), strict=True))
    for index, state in optimizer.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):  # DeepSpeed's flat moments, unflattened exactly
            assert torch.equal(state[key], expected[key][names[index]]), (index, key)
        assert state["step"].item() == 3
    assert scheduler.last_epoch == 3  # and the LR it set, still warming up
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * 4 / 6)
    rt.close()


def test_inspect_tells_what_a_deepspeed_directory_holds(zero_dir, run_cli):
    result = run_cli("checkpoint", "inspect", str(zero_dir / "ds"))
    assert result.returncode == 0, result.stderr
    shown = {line[:11].strip(): line[13:] for line in result.stdout.splitlines()}
    assert {k: shown[k] for k in ("format", "step", "world size", "parameters", "optimizer",
                                  "scheduler")} == {
        "format": "DeepSpeed ZeRO-2, 2 rank(s)", "step": "3", "world size": "2",
        "parameters": "161", "optimizer": "AdamW state of 4 parameters", "scheduler": "True"}


def test_the_imported_run_goes_on_on_deepspeeds_own_curve(zero_dir, tmp_path, run_cli):
    deepspeed_curve = json.loads((zero_dir / "deepspeed.json").read_text())["loss"]
    curves = {}
    for how, flags in (("whole", []), ("weights", ["--weights-only"])):
        result = run_cli("checkpoint", "convert", str(zero_dir / "ds"), str(tmp_path / how),
                         *flags)
        assert result.returncode == 0, result.stderr
        rt, _, _, scheduler, info = resume(tmp_path / how)
        curves[how] = continue_in_mpt(rt, scheduler, info["step"], STEPS)
        rt.close()
    for step, loss in curves["whole"].items():
        want = deepspeed_curve[step - 1]
        assert abs(loss - want) <= 1e-5 * abs(want), (step, loss, want)
    # the test can tell: without the moments the very next update is another one
    assert abs(curves["weights"][SAVE_AT + 2] - deepspeed_curve[SAVE_AT + 1]) > 1e-3


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


def test_a_missing_rank_file_or_tag_is_one_line_naming_it(zero_dir, tmp_path, run_cli):
    partial = tmp_path / "ds"
    shutil.copytree(zero_dir / "ds", partial)
    (partial / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    result = run_cli("checkpoint", "convert", str(partial), str(tmp_path / "x"))
    assert result.returncode == 2
    assert "saved by 2 ranks and zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in \
        result.stderr
    (partial / "latest").unlink()
    result = run_cli("checkpoint", "convert", str(partial), str(tmp_path / "x"))
    assert result.returncode == 2 and "no 'latest' file" in result.stderr
    assert "global_step3" in result.stderr  # the tags it has
    result = run_cli("checkpoint", "convert", str(partial), str(tmp_path / "x"),
                     "--tag", "global_step9")
    assert result.returncode == 2 and "tag 'global_step9' has no model states" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_another_optimizer_or_other_names_are_refused_at_load(zero_dir, tmp_path, run_cli):
    assert run_cli("checkpoint", "convert", str(zero_dir / "ds"),
                   str(tmp_path / "mpt")).returncode == 0
    with pytest.raises(CheckpointError, match=r"its optimizer state is AdamW's .* has a SGD"):
        resume(tmp_path / "mpt", torch.optim.SGD)
    # the weights alone load into any optimizer
    assert run_cli("checkpoint", "convert", str(zero_dir / "ds"), str(tmp_path / "weights"),
                   "--weights-only").returncode == 0
    rt, *_, info = resume(tmp_path / "weights", torch.optim.SGD)
    assert info["step"] == 3
    rt.close()
    rt = mpt.Runtime(env={})
    renamed = nn.Sequential()
    renamed.add_module("fc1", nn.Linear(8, 16))
    renamed.add_module("act", nn.Tanh())
    renamed.add_module("fc2", nn.Linear(16, 1))
    renamed, _ = rt.setup(renamed, torch.optim.AdamW(renamed.parameters()))
    with pytest.raises(CheckpointError, match=r"has fc1\.weight, fc1\.bias, fc2\.weight, which "
                                              r"it lacks \(its names that differ: 0\.bias"):
        rt.load(tmp_path / "mpt")
    rt.close()


def test_a_directory_of_no_known_format_lists_the_known_ones(tmp_path, run_cli):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    result = run_cli("checkpoint", "convert", str(tmp_path), str(tmp_path / "x"))
    assert result.returncode == 2 and "it is in no format mpt imports" in result.stderr
    assert "DeepSpeed" in result.stderr and "torch.distributed.checkpoint" in result.stderr
    assert not (tmp_path / "x").exists()
