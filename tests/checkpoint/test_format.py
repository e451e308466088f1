"""The checkpoint format in one process: contents, checksums, no unpickling, keep-k, fsspec."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import mpt
from mpt.checkpoint import CheckpointError
from mpt.checkpoint.io import resolve


def trained_runtime(precision: str = "fp32") -> tuple[mpt.Runtime, nn.Module, torch.optim.Adam,
                                                      torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(0)
    rt = mpt.Runtime(precision=precision, loss_scale="dynamic", env={})
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, opt = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    for _ in range(3):
        with rt.autocast():
            loss = model(torch.randn(5, 4)).float().pow(2).mean()
        rt.backward(loss)
        rt.step()
        sched.step()
    return rt, model, opt, sched


def spoil(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    opt.state.clear()


def test_round_trip_restores_weights_moments_scaler_scheduler_rng_and_extras(tmp_path):
    rt, model, opt, sched = trained_runtime("fp16-mixed")
    rt.precision.scaler.update(new_scale=512.0)  # a scale that differs from the initial one
    rt.precision.skipped_steps = 2
    want_precision = rt.precision.state_dict()
    want_weights = {k: v.clone() for k, v in model.state_dict().items()}
    want_moment = opt.state[opt.param_groups[0]["params"][0]]["exp_avg_sq"].clone()
    want_rng = torch.get_rng_state()
    extra = {"best": 0.5, "tags": ("a", 1), "ids": {3: "three"}, "table": torch.arange(3)}
    where = rt.save(tmp_path / "ckpt", step=3, epoch=1, scheduler=sched, **extra)
    assert where.endswith("step-000000003")

    torch.rand(10)
    spoil(model, opt)
    rt.precision.scaler.update(new_scale=1.0)
    rt.precision.skipped_steps = 0
    sched2 = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    info = rt.load(tmp_path / "ckpt", scheduler=sched2)

    assert info.pop("table").tolist() == [0, 1, 2]
    assert info == {"step": 3, "epoch": 1, "best": 0.5, "tags": ("a", 1), "ids": {3: "three"}}
    assert rt.precision.state_dict() == want_precision and rt.precision.loss_scale == 512.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, want_weights[k])
    assert torch.equal(opt.state[opt.param_groups[0]["params"][0]]["exp_avg_sq"], want_moment)
    assert sched2.state_dict() == sched.state_dict() and sched2.get_last_lr() == sched.get_last_lr()
    assert torch.equal(torch.get_rng_state(), want_rng)


def test_the_directory_is_plain_safetensors_and_json_keyed_by_model_and_parameter_name(tmp_path):
    rt, model = trained_runtime()[:2]
    ckpt = Path(rt.save(tmp_path / "ckpt", step=3))
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "manifest.json", "model.safetensors", "state.json", "state.safetensors"]
    assert sorted(load_file(ckpt / "model.safetensors")) == sorted(
        f"model/{name}" for name in model.state_dict())
    state = load_file(ckpt / "state.safetensors")
    assert "optimizer/model/state/0.weight/exp_avg" in state and "rng/0/torch" in state
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert {k: manifest[k] for k in ("format", "backend", "world_size", "precision", "step",
                                     "sharded", "parameters")} == {
        "format": 2, "backend": "ddp", "world_size": 1, "precision": "fp32", "step": 3,
        "sharded": False, "parameters": 4 * 8 + 8 + 8 * 2 + 2}
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-000000003"


@pytest.mark.parametrize("name", ["model.safetensors", "state.safetensors", "state.json"])
def test_a_flipped_byte_is_refused_naming_the_file_and_its_checksum(tmp_path, name):
    rt = trained_runtime()[0]
    ckpt = Path(rt.save(tmp_path / "ckpt", step=3))
    data = bytearray((ckpt / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (ckpt / name).write_bytes(bytes(data))
    sha = json.loads((ckpt / "manifest.json").read_text())["files"][name]["sha256"]
    with pytest.raises(CheckpointError, match=rf"{name}: sha256 [0-9a-f]{{64}} does not match "
                                              rf"the manifest's {sha}"):
        rt.load(tmp_path / "ckpt")


def test_a_truncated_file_and_an_edited_manifest_are_refused(tmp_path):
    rt = trained_runtime()[0]
    ckpt = Path(rt.save(tmp_path / "ckpt", step=3))
    full = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(full[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: it has 100 bytes, the "
                                              rf"manifest says {len(full)} \(sha256 "):
        rt.load(ckpt)
    (ckpt / "model.safetensors").write_bytes(full)
    (ckpt / "manifest.json").write_text((ckpt / "manifest.json").read_text()[:-20])
    with pytest.raises(CheckpointError, match=r"manifest\.json: the manifest is unreadable"):
        rt.load(ckpt)


class Planted:
    """Unpickling this creates a marker file: proof that a load executed it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_is_never_executed_even_with_a_matching_manifest(tmp_path):
    rt = trained_runtime()[0]
    ckpt = Path(rt.save(tmp_path / "ckpt", step=3))
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"model": Planted(marker)}, protocol=2)
    (ckpt / "model.safetensors").write_bytes(payload)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: it has \d+ bytes"):
        rt.load(ckpt)
    # An attacker who also rewrites the manifest's checksum gets a parse error, not execution.
    manifest = json.loads((ckpt / "manifest.json").read_text())

    manifest["files"]["model.safetensors"] = {"sha256": hashlib.sha256(payload).hexdigest(),
                                              "bytes": len(payload)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: it cannot be parsed"):
        rt.load(ckpt)
    assert not marker.exists()


def test_keep_last_k_and_latest(tmp_path):
    rt = trained_runtime()[0]
    for step in (1, 2, 3, 4, 5):
        rt.save(tmp_path / "ckpt", step=step, keep=2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "latest", "step-000000004", "step-000000005"]
    rt.save(tmp_path / "ckpt", step=2, keep=2)  # a restarted run: newest by time, not by step
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "latest", "step-000000002", "step-000000005"]
    assert rt.load(tmp_path / "ckpt")["step"] == 2
    with pytest.raises(mpt.UsageError, match="keep=0"):
        rt.save(tmp_path / "ckpt", step=9, keep=0)


def test_a_commit_whose_latest_update_was_cut_off_is_still_the_one_loaded(tmp_path):
    rt = trained_runtime()[0]
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        rt.save(root, step=step)
    (root / "latest").write_text("step-000000001")  # a kill between step 3's rename and pointer
    assert rt.load(root)["step"] == 3
    rt.save(root, step=2)  # a run resumed from step 2 saves again: newest by time, not by step
    (root / "latest").write_text("step-000000001")
    assert rt.load(root)["step"] == 2


def test_half_written_directories_are_never_taken_for_checkpoints(tmp_path):
    rt = trained_runtime()[0]
    root = tmp_path / "ckpt"
    rt.save(root, step=1)
    rt.save(root, step=2)
    # a later save cut short: its staging directory, and a step directory without a manifest
    shutil.copytree(root / "step-000000002", root / ".tmp-step-000000003-abc")
    shutil.copytree(root / "step-000000002", root / "step-000000004")
    (root / "step-000000004" / "manifest.json").unlink()
    assert resolve(root).path.endswith("step-000000002")
    (root / "latest").write_text("step-000000004")  # even when pointed at
    assert resolve(root).path.endswith("step-000000002")
    (root / "latest").unlink()
    assert rt.load(root)["step"] == 2
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        resolve(root / "step-000000004")


def test_fsspec_urls_memory_and_file(tmp_path):
    rt, model, opt, _ = trained_runtime()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    for url in ("memory://mpt-test/ckpt", f"file://{tmp_path}/ckpt"):
        where = rt.save(url, step=4, keep=1)
        rt.save(url, step=5, keep=1)
        assert where.startswith(url.split("/ckpt")[0])
        spoil(model, opt)
        assert rt.load(url)["step"] == 5
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-000000005"]
    import fsspec

    memory = fsspec.filesystem("memory")
    assert sorted(p.rsplit("/", 1)[1] for p in memory.ls("/mpt-test/ckpt", detail=False)) == [
        "latest", "step-000000005"]


def test_a_sharded_save_loads_in_one_process(tmp_path):
    rt, model, opt, _ = trained_runtime()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = Path(rt.save(tmp_path / "ckpt", step=3, sharded=True))
    assert not (ckpt / "model.safetensors").exists() and list((ckpt / "sharded").iterdir())
    spoil(model, opt)
    rt.load(ckpt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k])
    assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].abs().sum() > 0
    shard = next((ckpt / "sharded").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: it has"):
        rt.load(ckpt)


def test_values_a_checkpoint_cannot_hold_without_pickling_are_refused(tmp_path):
    rt = trained_runtime()[0]
    with pytest.raises(mpt.UsageError, match="extra/callback holds a function"):
        rt.save(tmp_path / "ckpt", step=1, callback=lambda: None)
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written
    with pytest.raises(CheckpointError, match="does not exist"):
        rt.load(tmp_path / "nothing-here")


def test_loading_a_missing_checkpoint_is_one_error_naming_it(tmp_path):
    rt = mpt.Runtime(env={}, quiet=True)
    model = nn.Linear(2, 2)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match=r"nope.*does not exist"):
        rt.load(tmp_path / "nope")


def test_a_tensor_file_reads_in_key_order_from_a_local_disk_and_an_fsspec_url(tmp_path):
    """Every rank gets a model's tensors in one order whatever the filesystem: fsdp scatters
    them in that order, and two orders are a collective mismatch."""
    from mpt.checkpoint import tensorfile
    from mpt.checkpoint.io import Location

    tensors = {name: torch.full((i + 1,), float(i)) for i, name in
               enumerate(["b.weight", "a.bias", "c.weight", "a.weight", "0.bias", "10.bias"])}
    for url in (str(tmp_path / "local"), "memory://mpt-test-order"):
        where = Location.parse(url)
        with where.open_write("model.safetensors") as f:
            entry = tensorfile.write(f, tensors)
        got = tensorfile.read(where, "model.safetensors", entry)
        assert list(got) == sorted(tensors), url
        assert all(torch.equal(got[k], tensors[k]) for k in tensors)
