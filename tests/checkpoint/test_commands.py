"""`mpt checkpoint inspect` and `mpt checkpoint convert` through the CLI's entry point.

In-process (``mpt.cli.main`` with its exit code and output) rather than as subprocesses: each
`python -m mpt` costs seconds of imports on a loaded 2-core machine.
"""

from __future__ import annotations

import pickle

import torch
from torch import nn

import mpt


class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_inspect_prints_the_manifest_and_verifies_checksums(tmp_path, run_cli):
    rt = mpt.Runtime(precision="fp16-mixed", loss_scale=256.0, env={})
    model = nn.Linear(3, 2)
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rt.save(tmp_path / "ckpt", step=7, epoch=2)
    result = run_cli("checkpoint", "inspect", str(tmp_path / "ckpt"), "--verify")
    assert result.returncode == 0, result.stderr
    shown = {line[:11].strip(): line[13:] for line in result.stdout.splitlines()}
    assert {k: shown[k] for k in ("step", "epoch", "backend", "world size", "precision",
                                  "loss scale", "parameters", "checksums")} == {
        "step": "7", "epoch": "2", "backend": "ddp", "world size": "1",
        "precision": "fp16-mixed", "loss scale": "256", "parameters": "8",
        "checksums": "all match"}
    state = tmp_path / "ckpt" / "step-000000007" / "state.json"
    state.write_text(state.read_text().replace("256", "512"))
    result = run_cli("checkpoint", "inspect", str(tmp_path / "ckpt"), "--verify")
    assert result.returncode == 2 and "state.json" in result.stderr and "sha256" in result.stderr


def test_convert_imports_an_apex_era_file_and_refuses_a_pickle(tmp_path, run_cli):
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    apex_era = {"model": {f"module.{k}": v for k, v in source.state_dict().items()},
                "optimizer": {"state": {}, "param_groups": []},
                "amp": {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17}}}
    torch.save(apex_era, tmp_path / "old.pt")
    result = run_cli("checkpoint", "convert", str(tmp_path / "old.pt"), str(tmp_path / "new"),
                     "--step", "5")
    assert result.returncode == 0, result.stderr
    rt = mpt.Runtime(precision="fp16-mixed", env={})
    target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    target, _ = rt.setup(target, torch.optim.SGD(target.parameters(), lr=0.1))
    assert rt.load(tmp_path / "new")["step"] == 5
    for k, v in target.state_dict().items():
        assert torch.equal(v, source.state_dict()[k])
    assert rt.precision.loss_scale == 1024.0

    marker = tmp_path / "pwned"
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"model": Planted(marker)}, protocol=2))
    result = run_cli("checkpoint", "convert", str(tmp_path / "evil.pt"), str(tmp_path / "x"))
    assert result.returncode == 2 and "weights_only=True" in result.stderr
    assert not marker.exists() and not (tmp_path / "x").exists()
