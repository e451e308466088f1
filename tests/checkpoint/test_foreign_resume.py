"""Runs started by plain DeepSpeed, FSDP2 and DDP scripts, converted and resumed in mpt (slow).

Each case runs the plain script with real processes (2 ranks on gloo: DeepSpeed's engine at a
ZeRO stage, ``fully_shard`` + ``dcp.save``, DDP + ``torch.save``), which saves after step 3
and goes on to step 8; `mpt checkpoint convert` imports the checkpoint, and `mpt launch
--resume` goes on from it under mpt's backends and world sizes. The losses of steps 4-8 must
be the plain script's own (fp32: 1e-5 relative; bf16: 1e-2). Under ZeRO the imported fp32
masters and Adam moments must also be DeepSpeed's, bit for bit. The fast cases (ZeRO-2 into
ddp at 1 process in-process, one-process torch.save and DCP) are in test_convert_zero.py and
test_foreign.py. And back: an mpt run exported ``--to dcp`` goes on in the plain FSDP2 script
(2 ranks) on mpt's curve.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import make_model
from conftest import ds_env, find_free_port, run_mpt, worker
from foreign_common import continue_in_mpt, make_adamw, make_warmup

import mpt

pytestmark = pytest.mark.slow
SAVE_AT, STEPS = 3, 8


def launch(*args: str, gpus: int = 2, flags: tuple[str, ...] = ()) -> None:
    result = run_mpt("launch", "--gpus", str(gpus), "--master-port", str(find_free_port()),
                     *flags, *args, timeout=300, env=ds_env())
    assert result.returncode == 0, result.stderr[-3000:]


def convert(run_cli, source: Path, target: Path) -> None:
    result = run_cli("checkpoint", "convert", str(source), str(target))
    assert result.returncode == 0, result.stderr
    assert f"step {SAVE_AT}" in result.stdout and "AdamW state of 4 parameters" in result.stdout


def check_curve(out: Path, reference: list[float], backend: str, world: int,
                rel: float) -> None:
    resumed = json.loads((out / f"mpt-{backend}-{world}.json").read_text())
    assert resumed["step"] == SAVE_AT
    assert [int(s) for s in resumed["loss"]] == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in resumed["loss"].items():
        want = reference[int(step) - 1]
        assert abs(loss - want) <= rel * abs(want), (backend, world, step, loss, want)


def resume_everywhere(out: Path, converted: Path, reference: list[float],
                      where: list[tuple[str, int]], precision: str = "fp32",
                      rel: float = 1e-5) -> None:
    for backend, world in where:
        launch(worker("foreign_resume.py"), str(out), str(STEPS), gpus=world,
               flags=("--backend", backend, "--precision", precision, "--resume",
                      str(converted)))
        check_curve(out, reference, backend, world, rel)


def check_masters_and_moments(converted: Path, expected_file: Path) -> None:
    """The converted checkpoint, loaded, holds DeepSpeed's own full fp32 masters and moments."""
    expected = torch.load(expected_file, weights_only=True)
    rt = mpt.Runtime(env={})
    model = make_model()
    model, optimizer = rt.setup(model, make_adamw(model))
    rt.load(converted, scheduler=make_warmup(optimizer))
    state = rt.backend.optimizer_state_dict(model, optimizer)["state"]
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected["fp32"][name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][key], expected[key][name]), (name, key)
    rt.close()


EVERY_BACKEND = [("ddp", 1), ("fsdp", 2), ("deepspeed", 2), ("apex", 2)] + (
    [("horovod", 2)] if importlib.util.find_spec("horovod") else [])


@pytest.mark.parametrize(("stage", "where"), [
    (2, EVERY_BACKEND), (3, [("ddp", 1), ("fsdp", 2)]), (1, [("ddp", 1)]), (0, [("ddp", 1)])])
def test_deepspeed_run_goes_on_in_mpt(stage, where, tmp_path, run_cli):
    launch(worker("foreign_deepspeed.py"), str(tmp_path), str(stage), str(SAVE_AT), str(STEPS))
    convert(run_cli, tmp_path / "ds", tmp_path / "mpt")
    if stage > 0:
        check_masters_and_moments(tmp_path / "mpt", tmp_path / "expected.pt")
    reference = json.loads((tmp_path / "deepspeed.json").read_text())["loss"]
    resume_everywhere(tmp_path, tmp_path / "mpt", reference, where)


def test_deepspeed_bf16_run_goes_on_in_mpt_bf16(tmp_path, run_cli):
    launch(worker("foreign_deepspeed.py"), str(tmp_path), "2", str(SAVE_AT), str(STEPS), "bf16")
    convert(run_cli, tmp_path / "ds", tmp_path / "mpt")
    check_masters_and_moments(tmp_path / "mpt", tmp_path / "expected.pt")
    reference = json.loads((tmp_path / "deepspeed.json").read_text())["loss"]
    resume_everywhere(tmp_path, tmp_path / "mpt", reference, [("ddp", 1)],
                      precision="bf16-mixed", rel=1e-2)


def test_deepspeeds_own_adamw_goes_on_as_torchs_adamw_in_mpt(tmp_path, run_cli):
    # DeepSpeed's optimizer from the config (its C++ Adam: built once, ~1 min, then cached)
    launch(worker("foreign_deepspeed.py"), str(tmp_path), "2", str(SAVE_AT), str(STEPS),
           "ds-adamw")
    convert(run_cli, tmp_path / "ds", tmp_path / "mpt")
    check_masters_and_moments(tmp_path / "mpt", tmp_path / "expected.pt")
    reference = json.loads((tmp_path / "deepspeed.json").read_text())["loss"]
    resume_everywhere(tmp_path, tmp_path / "mpt", reference, [("ddp", 1)])


def test_fsdp2_dcp_run_goes_on_in_mpt(tmp_path, run_cli):
    launch(worker("foreign_fsdp2.py"), str(tmp_path), str(SAVE_AT), str(STEPS))
    convert(run_cli, tmp_path / "dcp", tmp_path / "mpt")
    reference = json.loads((tmp_path / "fsdp2.json").read_text())["loss"]
    resume_everywhere(tmp_path, tmp_path / "mpt", reference, [("ddp", 1), ("fsdp", 2)])


def test_ddp_torch_save_run_goes_on_in_mpt(tmp_path, run_cli):
    launch(worker("foreign_ddp.py"), str(tmp_path), str(SAVE_AT), str(STEPS))
    convert(run_cli, tmp_path / "ddp.pt", tmp_path / "mpt")
    reference = json.loads((tmp_path / "ddp.json").read_text())["loss"]
    resume_everywhere(tmp_path, tmp_path / "mpt", reference, [("ddp", 1), ("ddp", 2)])


def test_an_mpt_run_exported_to_dcp_goes_on_in_a_plain_fsdp2_script(tmp_path, run_cli):
    rt = mpt.Runtime(env={})  # mpt's run: ddp, 1 process, saves after step 3 and goes on
    model = make_model()
    model, optimizer = rt.setup(model, make_adamw(model))
    scheduler = make_warmup(optimizer)
    continue_in_mpt(rt, scheduler, 0, SAVE_AT)
    rt.save(tmp_path / "ckpt", step=SAVE_AT, scheduler=scheduler)
    mpt_curve = continue_in_mpt(rt, scheduler, SAVE_AT, STEPS)
    rt.close()
    result = run_cli("checkpoint", "convert", str(tmp_path / "ckpt"), str(tmp_path / "dcp"),
                     "--to", "dcp")
    assert result.returncode == 0, result.stderr
    launch(worker("foreign_fsdp2.py"), str(tmp_path), "0", str(STEPS), str(tmp_path / "dcp"))
    plain = json.loads((tmp_path / "fsdp2-resumed.json").read_text())["loss"]
    assert [int(step) for step in plain] == list(mpt_curve)
    for step, loss in plain.items():
        assert loss == pytest.approx(mpt_curve[int(step)], rel=1e-5), step
