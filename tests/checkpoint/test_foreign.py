"""`mpt checkpoint convert` between plain torch scripts' checkpoints and mpt's, both ways.

Each source is written here by the library itself, in this process: a one-process script's
``torch.save`` of its model, optimizer and scheduler, and its ``dcp.save`` of what
``get_state_dict`` returns. The mpt run (ddp, 1 process) that loads the conversion must go on
exactly as the script went on; and the script that loads an mpt checkpoint exported ``--to``
its format must go on as mpt went on. Two and more processes, FSDP2 and DDP sources, and other
backends resuming: test_foreign_resume.py (slow).
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import make_model
from foreign_common import (
    continue_in_mpt,
    load_dcp,
    load_torch,
    make_adamw,
    make_warmup,
    plain_run,
    save_dcp,
    save_torch,
)

import mpt

SAVE_AT, STEPS = 3, 8
# what dcp.save says when a one-process script calls it, as these do
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_a_plain_scripts_checkpoint_resumes_in_mpt_on_its_curve(fmt, tmp_path, run_cli):
    source = tmp_path / ("ckpt.pt" if fmt == "torch" else "dcp")
    saver = save_torch if fmt == "torch" else save_dcp
    plain = plain_run(make_model(), STEPS, SAVE_AT, saver(source))
    result = run_cli("checkpoint", "inspect", str(source), "--json")
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert (facts["step"], facts["optimizer"], facts["scheduler"]) == (
        SAVE_AT, "AdamW state of 4 parameters", True)
    result = run_cli("checkpoint", "convert", str(source), str(tmp_path / "mpt"))
    assert result.returncode == 0, result.stderr
    assert "AdamW state of 4 parameters, LR scheduler; step 3" in result.stdout
    for loaded in (tmp_path / "mpt", source):  # converted, or the source itself imported
        rt = mpt.Runtime(env={}, resume=str(loaded))
        model = make_model()
        model, optimizer = rt.setup(model, make_adamw(model))
        scheduler = make_warmup(optimizer)
        info = rt.resume(scheduler=scheduler)
        assert info["step"] == SAVE_AT
        resumed = continue_in_mpt(rt, scheduler, info["step"], STEPS)
        rt.close()
        assert list(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
        for step, loss in resumed.items():
            assert loss == pytest.approx(plain[step], rel=1e-5), (loaded, step)


def test_resuming_a_foreign_checkpoint_says_what_it_lacks(tmp_path, capsys):
    source = tmp_path / "ckpt.pt"
    plain_run(make_model(), SAVE_AT, SAVE_AT, save_torch(source))
    rt = mpt.Runtime(env={}, resume=str(source))
    model = make_model()
    rt.setup(model, make_adamw(model))
    assert rt.resume()["step"] == SAVE_AT
    rt.close()
    said = [line for line in capsys.readouterr().out.splitlines() if "imported" in line]
    assert len(said) == 1 and "the data loader's position, the RNG states" in said[0]
    with pytest.raises(mpt.UsageError, match=r"a torch\.save file"):
        mpt.Runtime(env={}, resume=str(tmp_path / "nothing-here"))


def test_numbered_state_is_named_past_batchnorm_buffers(tmp_path, run_cli):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 6),
                          nn.BatchNorm1d(6), nn.Linear(6, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               tmp_path / "bn.pt")
    assert run_cli("checkpoint", "convert", str(tmp_path / "bn.pt"),
                   str(tmp_path / "mpt")).returncode == 0
    rt = mpt.Runtime(env={})
    target = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 6),
                           nn.BatchNorm1d(6), nn.Linear(6, 1))
    target, loaded = rt.setup(target, torch.optim.SGD(target.parameters(), lr=0.5, momentum=0.1))
    rt.load(tmp_path / "mpt")
    for (name, param), mine in zip(model.named_parameters(), target.parameters(), strict=True):
        assert torch.equal(loaded.state[mine]["momentum_buffer"],
                           optimizer.state[param]["momentum_buffer"]), name
    assert loaded.param_groups[0]["momentum"] == 0.9
    assert torch.equal(target[1].running_mean, model[1].running_mean)
    rt.close()


def test_numbered_groups_out_of_model_order_are_named_only_by_their_param_names(tmp_path,
                                                                              run_cli):
    """torch numbers parameters group by group: two groups in another order than the model's,
    named by the model's order, would swap moments and learning rates of same-shaped tensors;
    refused unless the groups carry their names (an optimizer built from named_parameters)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    for named in (False, True):
        def group(layer: str, lr: float) -> dict:
            params = [(n, p) for n, p in model.named_parameters() if n.startswith(f"{layer}.")]
            return {"params": params if named else [p for _, p in params], "lr": lr}

        optimizer = torch.optim.SGD([group("2", 0.01), group("0", 0.1)], momentum=0.9)
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   tmp_path / f"groups-{named}.pt")
        result = run_cli("checkpoint", "convert", str(tmp_path / f"groups-{named}.pt"),
                         str(tmp_path / f"mpt-{named}"))
        if not named:
            assert result.returncode == 2
            assert "2 param groups and no parameter names" in result.stderr, result.stderr
            assert not (tmp_path / f"mpt-{named}").exists()
            continue
        assert result.returncode == 0, result.stderr
        rt = mpt.Runtime(env={})
        target = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        _, loaded = rt.setup(target, torch.optim.SGD([
            {"params": list(target[2].parameters()), "lr": 0.01},
            {"params": list(target[0].parameters()), "lr": 0.1}], momentum=0.9))
        rt.load(tmp_path / f"mpt-{named}")
        for mine, theirs in ((target[0].weight, model[0].weight),
                             (target[2].weight, model[2].weight)):
            assert torch.equal(loaded.state[mine]["momentum_buffer"],
                               optimizer.state[theirs]["momentum_buffer"])
        assert [g["lr"] for g in loaded.param_groups] == [0.01, 0.1]
        rt.close()


def test_an_optimizer_over_part_of_the_model_is_refused(tmp_path, run_cli):
    model = make_model()
    optimizer = torch.optim.Adam(model[2].parameters())  # the first layer frozen
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               tmp_path / "part.pt")
    result = run_cli("checkpoint", "convert", str(tmp_path / "part.pt"), str(tmp_path / "x"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "its optimizer holds 2 parameters and its model 4" in result.stderr
    assert "--weights-only" in result.stderr and not (tmp_path / "x").exists()
    result = run_cli("checkpoint", "convert", str(tmp_path / "part.pt"), str(tmp_path / "x"),
                     "--weights-only")
    assert result.returncode == 0 and "the optimizer's state (--weights-only)" in result.stdout


def mpt_run(root: Path) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """An mpt run (ddp, 1 process) of the plain scripts' model, optimizer and schedule that
    saves under ``root`` after step 3 and goes on: the losses after the save, and the weights
    at it."""
    rt = mpt.Runtime(env={})
    model = make_model()
    model, optimizer = rt.setup(model, make_adamw(model))
    scheduler = make_warmup(optimizer)
    continue_in_mpt(rt, scheduler, 0, SAVE_AT)
    rt.save(root, step=SAVE_AT, scheduler=scheduler)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    losses = continue_in_mpt(rt, scheduler, SAVE_AT, STEPS)
    rt.close()
    return losses, saved


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_an_exported_mpt_run_goes_on_in_a_plain_script_on_mpts_curve(fmt, tmp_path, run_cli):
    losses, _ = mpt_run(tmp_path / "ckpt")
    target = tmp_path / ("run.pt" if fmt == "torch" else "dcp")
    result = run_cli("checkpoint", "convert", str(tmp_path / "ckpt"), str(target), "--to", fmt)
    assert result.returncode == 0, result.stderr
    assert "weights, optimizer, LR scheduler; step 3" in result.stdout
    plain = plain_run(make_model(), STEPS, load=(load_torch if fmt == "torch" else load_dcp)(
        target))
    assert list(plain) == list(losses)
    for step, loss in plain.items():
        assert loss == pytest.approx(losses[step], rel=1e-5), step


def test_safetensors_export_holds_the_weights_under_their_names(tmp_path, run_cli):
    _, saved = mpt_run(tmp_path / "ckpt")
    result = run_cli("checkpoint", "convert", str(tmp_path / "ckpt"),
                     str(tmp_path / "model.safetensors"), "--to", "safetensors")
    assert result.returncode == 0, result.stderr
    exported = load_file(tmp_path / "model.safetensors")
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    again = run_cli("checkpoint", "convert", str(tmp_path / "ckpt"),
                    str(tmp_path / "model.safetensors"), "--to", "safetensors")
    assert again.returncode == 2 and "it exists already" in again.stderr


class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_planted_in_dcp_metadata_is_never_run(tmp_path, run_cli):
    plain_run(make_model(), SAVE_AT, SAVE_AT, save_dcp(tmp_path / "dcp"))
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    result = run_cli("checkpoint", "convert", str(tmp_path / "dcp"), str(tmp_path / "x"))
    assert result.returncode == 2 and "io.open is not DCP metadata" in result.stderr
    assert not marker.exists() and not (tmp_path / "x").exists()
