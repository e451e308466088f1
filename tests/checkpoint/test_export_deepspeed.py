"""`mpt checkpoint convert ckpt DST --to deepspeed`: an mpt run goes on in a plain DeepSpeed script.

The mpt run (ddp, 1 process, in this process: AdamW, a warm-up schedule still rising, gradient
clipping) saves after step 3, whole and sharded, and goes on to step 8. The export must hold
its whole state in DeepSpeed's universal layout (checked file by file here, and read back by
mpt's own import); and a plain DeepSpeed script (workers/ds_from_mpt.py: no mpt in it, real
processes) that resumes it with ``engine.load_checkpoint`` at ZeRO 0, 1 and 2, on 1 and 2
ranks (ZeRO-3 on 2), must follow the mpt run's curve (slow). And the other way (slow): what
DeepSpeed's own ``ds_to_universal.py`` makes of a ZeRO-2 or ZeRO-3 checkpoint imports with
DeepSpeed's masters and moments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import make_model
from conftest import ds_env, find_free_port, run_mpt, worker
from foreign_common import continue_in_mpt, make_adamw, make_warmup

import mpt
from mpt.checkpoint.foreign import universal

SAVE_AT, STEPS = 3, 8
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]  # the optimizer's order: the model's


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The mpt run: its checkpoints at step 3 (``whole``, ``sharded``), its weights and
    optimizer state then, and the losses of steps 4-8."""
    root = tmp_path_factory.mktemp("mpt")
    rt = mpt.Runtime(env={})
    model = make_model()
    model, optimizer = rt.setup(model, make_adamw(model))
    scheduler = make_warmup(optimizer)
    continue_in_mpt(rt, scheduler, 0, SAVE_AT)
    rt.save(root / "whole", step=SAVE_AT, epoch=0, scheduler=scheduler)
    rt.save(root / "sharded", step=SAVE_AT, epoch=0, scheduler=scheduler, sharded=True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = rt.backend.optimizer_state_dict(model, optimizer)["state"]
    moments = {name: {k: v.clone() for k, v in entry.items()} for name, entry in state.items()}
    lr, schedule = optimizer.param_groups[0]["lr"], scheduler.state_dict()
    curve = continue_in_mpt(rt, scheduler, SAVE_AT, STEPS)
    rt.close()
    return SimpleNamespace(root=root, weights=weights, moments=moments, lr=lr,
                           schedule=schedule, curve=curve)


def load(path: Path) -> object:
    return torch.load(path, weights_only=True)  # plain data: no DeepSpeed class in any file


@pytest.mark.parametrize("layout", ["whole", "sharded"])
def test_the_export_holds_the_whole_state_in_deepspeeds_universal_layout(layout, saved, tmp_path,
                                                                         run_cli):
    target = tmp_path / "ds"
    result = run_cli("checkpoint", "convert", str(saved.root / layout), str(target),
                     "--to", "deepspeed")
    assert result.returncode == 0, result.stderr
    said = result.stdout.splitlines()
    assert len(said) == 2 and "weights, optimizer, LR scheduler; step 3" in said[0]
    assert said[1].startswith("not in it") and "the RNG states" in said[1]
    tag = target / "global_step3"
    assert [(target / name).read_text() for name in universal.LATEST] == ["global_step3"] * 2
    assert sorted(str(p.relative_to(tag)) for p in tag.rglob("*.pt")) == sorted(
        ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt",
         "zero/optimizer_state.pt"] + [
            f"zero/{name}/{key}.pt" for name in NAMES
            for key in ("fp32", "exp_avg", "exp_avg_sq", "step")])
    states = load(tag / "mp_rank_00_model_states.pt")
    assert (states["step"], states["epoch"], states["global_steps"]) == (3, 0, 3)
    assert states["lr_scheduler"] == saved.schedule
    assert states["param_shapes"] == [{name: saved.weights[name].shape for name in NAMES}]
    assert all(torch.equal(states["module"][k], v) for k, v in saved.weights.items())
    zero3 = load(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")  # what ZeRO-3 reads
    assert zero3 == {k: v for k, v in states.items() if k not in ("module", "optimizer")}
    for name in NAMES:
        folder = tag / "zero" / name
        assert torch.equal(load(folder / "fp32.pt")["param"], saved.weights[name])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(load(folder / f"{key}.pt")["param"], saved.moments[name][key])
        assert load(folder / "step.pt").item() == 3
    groups = load(tag / "zero" / "optimizer_state.pt")["param_groups"]
    assert [(g["lr"], g["weight_decay"], g["params"]) for g in groups] == [(saved.lr, 0.1, [0])]

    # mpt's own import reads the layout back (inspect, convert): the same state, bit for bit
    facts = json.loads(run_cli("checkpoint", "inspect", str(target), "--json").stdout)
    assert {k: facts[k] for k in ("format", "step", "epoch", "optimizer", "scheduler")} == {
        "format": "DeepSpeed universal checkpoint, 1 rank(s)", "step": 3, "epoch": 0,
        "optimizer": "AdamW state of 4 parameters", "scheduler": True}
    rt = mpt.Runtime(env={}, resume=str(target))
    model = make_model()
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters()))
    scheduler = make_warmup(optimizer)
    info = rt.resume(scheduler=scheduler)
    assert (info["step"], info["epoch"]) == (3, 0)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.weights.items())
    state = rt.backend.optimizer_state_dict(model, optimizer)["state"]
    assert all(torch.equal(state[n][k], v) for n, m in saved.moments.items() for k, v in m.items())
    assert optimizer.param_groups[0]["lr"] == saved.lr and scheduler.last_epoch == 3
    rt.close()


def test_a_failed_or_refused_export_writes_nothing(saved, tmp_path, run_cli, monkeypatch):
    def broken(run):
        raise mpt.UsageError("SRC", run.location, "broken on purpose", "none")

    monkeypatch.setattr(universal, "client_state", broken)  # after every zero/ file is written
    result = run_cli("checkpoint", "convert", str(saved.root / "whole"), str(tmp_path / "ds"),
                     "--to", "deepspeed")
    assert result.returncode == 2 and "broken on purpose" in result.stderr
    assert list(tmp_path.iterdir()) == []  # neither DST nor its staging folder
    monkeypatch.undo()
    (tmp_path / "ds").mkdir()
    result = run_cli("checkpoint", "convert", str(saved.root / "whole"), str(tmp_path / "ds"),
                     "--to", "deepspeed")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "DST=" in result.stderr and "it exists already" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "world"), [(2, 1), (2, 2), (1, 2), (3, 2), (0, 1)])
def test_a_plain_deepspeed_script_goes_on_on_the_mpt_runs_curve(stage, world, saved, tmp_path,
                                                                run_cli):
    target = tmp_path / "ds"
    assert run_cli("checkpoint", "convert", str(saved.root / "whole"), str(target), "--to",
                   "deepspeed").returncode == 0
    result = run_mpt("launch", "--gpus", str(world), "--master-port", str(find_free_port()),
                     worker("ds_from_mpt.py"), str(target), str(tmp_path), str(stage),
                     str(STEPS), timeout=300, env=ds_env())
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = json.loads((tmp_path / f"ds-{stage}-{world}.json").read_text())
    assert (resumed["client_state"]["step"], resumed["client_state"]["epoch"]) == (3, 0)
    assert resumed["lr"] == pytest.approx(saved.lr) and resumed["global_steps"] == STEPS
    assert [int(step) for step in resumed["loss"]] == list(saved.curve)
    for step, loss in resumed["loss"].items():
        assert loss == pytest.approx(saved.curve[int(step)], rel=1e-5), (stage, world, step)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeeds_own_universal_checkpoint_imports_with_its_masters_and_moments(stage,
                                                                                 tmp_path,
                                                                                 run_cli):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(find_free_port()),
                     worker("foreign_deepspeed.py"), str(tmp_path), str(stage), str(SAVE_AT),
                     str(STEPS), timeout=300, env=ds_env())
    assert result.returncode == 0, result.stderr[-3000:]
    ds = tmp_path / "ds"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(ds / "global_step3"), "--output_folder",
                    str(ds / "global_step3_universal"), "--inject_missing_state"],
                   check=True, capture_output=True, timeout=300,
                   env={**os.environ, "DS_ACCELERATOR": "cpu"})
    (ds / "latest").unlink()  # ``latest_universal`` names the tag now
    result = run_cli("checkpoint", "convert", str(ds), str(tmp_path / "mpt"))
    assert result.returncode == 0, result.stderr
    assert "from DeepSpeed universal checkpoint, 2 rank(s): 4 tensors, AdamW state of 4 " \
        "parameters, LR scheduler; step 3, epoch 0" in result.stdout
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)  # DeepSpeed's own
    rt = mpt.Runtime(env={})
    model = make_model()
    model, optimizer = rt.setup(model, make_adamw(model))
    scheduler = make_warmup(optimizer)
    assert rt.load(tmp_path / "mpt", scheduler=scheduler)["step"] == 3
    state = rt.backend.optimizer_state_dict(model, optimizer)["state"]
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected["fp32"][name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][key], expected[key][name]), (name, key)
    assert scheduler.last_epoch == 3 and optimizer.param_groups[0]["lr"] == pytest.approx(
        0.02 * 4 / 6)
    rt.close()
