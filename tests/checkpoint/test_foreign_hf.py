"""Hugging Face safetensors weights as a run's initial weights (`--resume`, `rt.load`, inspect).

The files are written by the safetensors library itself (``safetensors.torch.save_file``), in
the layout ``transformers``' ``save_pretrained`` writes: ``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import make_model
from foreign_common import make_adamw

import mpt
from mpt.errors import CheckpointError


def pretrained() -> dict[str, torch.Tensor]:
    """Weights of the shared model other than its seeded start, so a load can be told."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0).add_(0.5)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def save_pretrained(folder: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    """What save_pretrained writes: one file, or ``shards`` files and their index."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "test"}))
    if shards == 1:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: weights[name] for name in names[i::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def test_a_safetensors_file_starts_a_run_with_its_weights_and_a_fresh_optimizer(
        tmp_path, run_cli, capsys):
    weights = pretrained()
    save_file(weights, str(tmp_path / "model.safetensors"))
    facts = json.loads(run_cli("checkpoint", "inspect", str(tmp_path / "model.safetensors"),
                               "--json").stdout)
    assert {k: facts[k] for k in ("format", "step", "tensors", "parameters", "optimizer")} == {
        "format": "Hugging Face safetensors, 1 file", "step": 0, "tensors": 4,
        "parameters": 161, "optimizer": "none"}
    rt = mpt.Runtime(env={}, resume=str(tmp_path / "model.safetensors"))
    model = make_model()
    model, optimizer = rt.setup(model, make_adamw(model))
    assert rt.resume()["step"] == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert not optimizer.state  # afresh: no moments
    rt.close()
    said = [line for line in capsys.readouterr().out.splitlines() if "imported" in line]
    assert len(said) == 1 and "Hugging Face safetensors, 1 file): 4 tensors" in said[0]
    assert "the optimizer's state" in said[0] and "the step (it starts at 0)" in said[0]


def test_a_sharded_save_pretrained_directory_is_read_one_file_at_a_time(tmp_path, run_cli,
                                                                         monkeypatch):
    weights = pretrained()
    save_pretrained(tmp_path / "hf", weights, shards=2)
    opened: list[str] = []
    closed: list[str] = []
    at_once: list[int] = []
    real = safetensors.safe_open

    @contextlib.contextmanager
    def counting(path, *args, **kwargs):
        opened.append(Path(path).name)
        at_once.append(len(opened) - len(closed))
        with real(path, *args, **kwargs) as f:
            yield f
        closed.append(path)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    rt = mpt.Runtime(env={})
    model = make_model()
    model, _ = rt.setup(model, make_adamw(model))
    assert rt.load(tmp_path / "hf")["step"] == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    rt.close()
    assert opened == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert max(at_once) == 1
    result = run_cli("checkpoint", "inspect", str(tmp_path / "hf"))
    assert "Hugging Face safetensors, 2 files" in result.stdout
    result = run_cli("checkpoint", "convert", str(tmp_path / "hf" / "model.safetensors.index.json"),
                     str(tmp_path / "mpt"))
    assert result.returncode == 0 and "4 tensors; step 0" in result.stdout


def test_other_names_are_listed_and_broken_files_refused_in_one_line(tmp_path, run_cli):
    save_file({name.replace("0.", "fc1.").replace("2.", "fc2."): t
               for name, t in pretrained().items()}, str(tmp_path / "renamed.safetensors"))
    rt = mpt.Runtime(env={})
    model = make_model()
    rt.setup(model, make_adamw(model))
    with pytest.raises(CheckpointError, match=r"has 0\.weight, 0\.bias, 2\.weight, which it "
                                              r"lacks \(its names that differ: fc1\.bias, "
                                              r"fc1\.weight, fc2\.bias\)"):
        rt.load(tmp_path / "renamed.safetensors")
    rt.close()

    save_pretrained(tmp_path / "hf", pretrained(), shards=2)
    (tmp_path / "hf" / "model-00002-of-00002.safetensors").unlink()
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors.index.json").write_text('{"metadata": {}}')
    for source, problem in ((tmp_path / "hf", "its shard model-00002-of-00002.safetensors is "
                             "missing (1 of 2)"),
                            (tmp_path / "garbage.safetensors", "safetensors refused it"),
                            (tmp_path / "bad", "it is no safetensors index")):
        result = run_cli("checkpoint", "convert", str(source), str(tmp_path / "x"))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
        assert problem in result.stderr, result.stderr
        assert not (tmp_path / "x").exists()
