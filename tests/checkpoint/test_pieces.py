"""Checkpoints of backends whose ranks hold pieces of the state (fsdp, ZeRO-3), on real gloo
ranks: each rank writes and reads back only its own pieces, and an optimizer saved before its
first step comes back fresh. Below them, the storage of flat ranges (ZeRO-3's partitions):
written by 3 ranks as whole rows, read back at 2 and 1 ranks into ranges of another cut, whole,
and into DTensor shards, for shapes whose rows straddle the ranks (and a scalar, leading and
inner ones, a row longer than a rank's range). A save of whole tensors under such a backend
says what it gathers, and is refused where the host lacks the memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import mpt
from mpt.errors import UsageError

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import run_mpt, worker
from flat_pieces import SHAPES, value


@pytest.mark.parametrize("backend", [("fsdp", "--fsdp-wrap", "Linear"),
                                     ("deepspeed", "--zero-stage", "3")], ids=["fsdp", "zero3"])
def test_each_rank_writes_and_reads_back_only_its_own_pieces(tmp_path, free_port, backend):
    if backend[0] == "deepspeed":
        pytest.importorskip("deepspeed", reason="`make` installs deepspeed into .venv")
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--backend",
                     *backend, worker("shard_pieces.py"), str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["changed"] and r["weights_back"] and r["moments_back"], r
        # saved before its first step: loaded as fresh, and steps 1-2 land where they did
        assert r["fresh_state"] and r["fresh_resumes"], r
    checkpoint = Path(ranks[0]["where"])
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["sharded"] and manifest["backend"] == backend[0]
    shards = sorted((checkpoint / "sharded").glob("*.safetensors"))
    assert len(shards) == 2  # one file per rank, each about its rank's share
    for shard, rank in zip(shards, ranks, strict=True):
        assert abs(shard.stat().st_size - rank["local_bytes"]) < 0.05 * rank["local_bytes"]
    assert not (checkpoint / "model.safetensors").exists()  # nothing gathered on rank 0


def _launch(ranks: int, directory: Path, mode: str, port: int) -> None:
    result = run_mpt("launch", "--gpus", str(ranks), "--master-port", str(port),
                     worker("flat_pieces.py"), str(directory), mode)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import find_free_port

    directory = tmp_path_factory.mktemp("flat")
    _launch(3, directory, "save", find_free_port())
    return directory


def test_each_rank_writes_only_the_rows_that_start_in_its_range(saved):
    files = sorted((saved / "ckpt").iterdir())
    assert [f.name.split("-")[1] for f in files] == ["00001", "00002", "00003"]
    from safetensors import safe_open

    stored = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, no dict)
                stored.setdefault(key, []).append(handle.get_slice(key).get_shape())
    # (7, 5) over 3 ranks of 12 elements: rows 0-2 start on rank 0 (the third completed from
    # rank 1), rows 3-4 on rank 1, rows 5-6 on rank 2.
    assert stored["matrix"] == [[3, 5], [2, 5], [2, 5]]
    assert stored["scalar"] == [[]]
    assert sum(rows for rows, _ in stored["wide"]) == 2  # a row longer than a rank's range


@pytest.mark.parametrize("ranks", [2, 1])
def test_reads_back_at_another_world_size_in_every_layout(saved, tmp_path, free_port, ranks):
    (tmp_path / "ckpt").symlink_to(saved / "ckpt")
    _launch(ranks, tmp_path, "load", free_port)
    for rank in range(ranks):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        for name, shape in SHAPES.items():
            whole = value(name).reshape(-1)
            size = -(-whole.numel() // ranks)
            start, got = report["ranges"][name]
            assert start == rank * size
            assert got == whole[start:start + size].tolist(), name
            assert report["whole"][name] == value(name).tolist(), name
            if shape:
                rows, full = report["rows"][name]
                chunks = torch.chunk(value(name), ranks)
                want = chunks[rank] if rank < len(chunks) else torch.empty(0, *shape[1:])
                assert torch.tensor(rows).reshape(want.shape).tolist() == want.tolist(), name
                assert full == list(shape)


def test_a_whole_save_of_pieces_says_what_it_gathers_and_is_refused_without_the_memory(
        tmp_path, capsys, monkeypatch):
    """fsdp holds pieces: sharded=False gathers the whole state (Adam's moments included) and
    says so; where the host lacks that memory, it is refused before anything is written."""
    import psutil

    rt = mpt.Runtime(env={}, backend="fsdp")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    model, _ = rt.setup(model, torch.optim.Adam(model.parameters()))
    rt.backward(model(torch.randn(2, 64)).sum())
    rt.step()
    rt.save(tmp_path / "whole", step=1, sharded=False)
    state = (64 * 64 + 64 + 64 * 8 + 8) * 4 * 3  # weights and two moments, fp32
    said = capsys.readouterr().out
    assert "mpt: this save (sharded=False) gathers the whole state, 0.00 GiB" in said
    rt.save(tmp_path / "pieces", step=1)
    assert "gathers" not in capsys.readouterr().out

    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=state // 2))
    with pytest.raises(UsageError, match=r"sharded=False is invalid: sharded=False gathers the "
                       r"whole state.*Fix: save to a local path"):
        rt.save(tmp_path / "refused", step=1, sharded=False)
    assert not (tmp_path / "refused").exists()
    rt.close()
