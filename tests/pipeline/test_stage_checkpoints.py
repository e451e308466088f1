"""A pipeline's sharded checkpoint in per-stage pieces: each rank writes and reads back only its
own stage's state (its shards of it under fsdp), and the checkpoint still moves to any stage
count, backend and world size.

The jobs run workers/pipeline_train.py (6 steps, saved after step 3) under
workers/stage_reads.py, which records the keys each rank's load read and whether ``rt.save``
gathered a stage's state over the stages. Below them, the pieces in one process: the union of
the ranks' optimizer structures, and a storage read that leaves keys unread.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import find_free_port, run_mpt, worker
from pipeline_train import make_model

from mpt.checkpoint import CheckpointError
from mpt.checkpoint.encode import encode, references
from mpt.checkpoint.held import merged_optimizers
from mpt.pipeline.split import stage_blocks

STAGES = {f"{block}.{leaf}": stage
          for stage, blocks in enumerate(stage_blocks(make_model(), 2))
          for block, module in blocks for leaf, _ in module.named_parameters()}
"""The stage of each of pipeline_train.py's parameters, split in 2 as the pipeline splits it."""


def launch(out: Path, gpus: int, *flags: str, script_args: tuple[str, ...] = (),
           report: Path | None = None, whole_saves: bool = False) -> dict:
    """Train pipeline_train.py under ``flags``, recorded into ``report`` (stage_reads.py)."""
    report = report or out.parent / f"{out.stem}-report"
    report.mkdir(exist_ok=True)
    wrapper = (worker("stage_reads.py"), str(report), *(["--whole-saves"] if whole_saves else []))
    result = run_mpt("launch", "--gpus", str(gpus), "--master-port", str(find_free_port()),
                     *flags, *wrapper, worker("pipeline_train.py"), str(out), *script_args,
                     timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def parameter(key: str) -> str:
    """The parameter a checkpoint key holds: ``model/<model>/<name>`` or
    ``optimizer/<model>/state/<name>/<field>``."""
    parts = key.split("/")
    assert parts[0] in ("model", "optimizer") and (parts[0] == "model" or parts[2] == "state"), key
    return parts[2] if parts[0] == "model" else parts[3]


def shard_keys(checkpoint: Path) -> dict[int, dict[str, int]]:
    """Each rank's keys in the checkpoint's shard files (their safetensors headers), with the
    bytes it wrote of each."""
    from safetensors import safe_open

    written: dict[int, dict[str, int]] = {}
    for path in sorted((checkpoint / "sharded").glob("*.safetensors")):
        rank = int(path.name.split("-")[1]) - 1  # shard-0000<rank + 1>-model-...
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, no dict)
                tensor = handle.get_tensor(key)
                written.setdefault(rank, {})[key] = tensor.numel() * tensor.element_size()
    return written


def assert_on_curve(resumed: dict, whole: dict) -> None:
    assert sorted(resumed["losses"], key=int) == ["4", "5", "6"]
    assert [resumed["losses"][s] for s in "456"] == pytest.approx(
        [whole["losses"][s] for s in "456"], rel=1e-6)
    for name, values in whole["weights"].items():
        assert resumed["weights"][name] == pytest.approx(values, rel=1e-6, abs=1e-7), name


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_each_stage_writes_and_reads_its_own_pieces_and_resumes_anywhere(tmp_path, backend):
    """P = 2 x D = 2 (4 processes) saves after step 3 without gathering: each rank's files
    hold its stage's keys only (under fsdp its shards of them). Resumed at P = 2 x D = 2,
    each rank reads its stage's keys alone (under fsdp, about half their bytes), and the run
    goes on as the uninterrupted one (1e-6); resumed at 2 processes without a pipeline under
    ddp, which reads the checkpoint whole, too."""
    pipeline = ("--backend", backend, "--pipeline-stages", "2")
    steps = ("--steps", "6")
    whole = launch(tmp_path / "whole.json", 4, *pipeline, script_args=(
        *steps, "--save-at", "3", "--ckpt", str(tmp_path / "ckpt")))
    checkpoint = tmp_path / "ckpt" / "step-000000003"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["sharded"] and manifest["world_size"] == 4
    assert not (checkpoint / "model.safetensors").exists()  # nothing gathered on rank 0
    saves = [json.loads((tmp_path / "whole-report" / f"saves-rank-{r}.json").read_text())
             for r in range(4)]
    assert all(save["gathers"] == 0 for save in saves), saves
    written = shard_keys(checkpoint)
    stored: dict[str, int] = {}
    for rank, keys in written.items():  # rank = stage x 2 + replica
        assert {STAGES[parameter(key)] for key in keys} == {rank // 2}, (rank, sorted(keys))
        for key, size in keys.items():
            stored[key] = stored.get(key, 0) + size
    assert {parameter(key) for key in stored} == set(STAGES)
    # state.json holds every stage's optimizer state, as one process names it
    state = json.loads((checkpoint / "state.json").read_text())["optimizers"]["model"]
    assert sorted(state["state"]) == sorted(STAGES)
    assert sorted(state["param_groups"][0]["params"]) == sorted(STAGES)

    resumed = launch(tmp_path / "pp2.json", 4, *pipeline, script_args=(
        *steps, "--resume", str(tmp_path / "ckpt")))
    assert_on_curve(resumed, whole)
    for rank in range(4):
        reads = json.loads((tmp_path / "pp2-report" / f"reads-rank-{rank}.json").read_text())
        mine = {key for key in stored if STAGES[parameter(key)] == rank // 2}
        assert set(reads["read"]) == mine, rank
        assert set(reads["unread"]) == set(stored) - mine, rank
        share = sum(reads["read"].values()) / sum(stored[key] for key in mine)
        assert share < 0.55 if backend == "fsdp" else share == 1.0, (rank, share)

    flat = launch(tmp_path / "ddp.json", 2, "--backend", "ddp", script_args=(
        *steps, "--resume", str(tmp_path / "ckpt")))
    assert_on_curve(flat, whole)
    reads = json.loads((tmp_path / "ddp-report" / "reads-rank-0.json").read_text())
    assert set(reads["read"]) == set(stored) and not reads["unread"]


@pytest.mark.slow
def test_a_whole_save_of_a_pipeline_gathers_onto_rank_0_and_resumes_at_one_stage(tmp_path):
    """``sharded=False`` under P = 2: the full weights in model.safetensors, as before."""
    steps = ("--steps", "6")
    whole = launch(tmp_path / "whole.json", 2, "--pipeline-stages", "2", whole_saves=True,
                   script_args=(*steps, "--save-at", "3", "--ckpt", str(tmp_path / "ckpt")))
    checkpoint = tmp_path / "ckpt" / "step-000000003"
    assert not json.loads((checkpoint / "manifest.json").read_text())["sharded"]
    assert (checkpoint / "model.safetensors").exists()
    assert not (checkpoint / "sharded").exists()
    saves = json.loads((tmp_path / "whole-report" / "saves-rank-0.json").read_text())
    assert saves["gathers"] == 2  # the weights, the optimizer state
    resumed = launch(tmp_path / "resumed.json", 1, script_args=(
        *steps, "--resume", str(tmp_path / "ckpt")))
    assert_on_curve(resumed, whole)


# -- the pieces, in one process -------------------------------------------------------------
def encoded(names: list[str], lr: float = 0.01) -> dict:
    """One rank's encoded optimizer structure (``state.json``'s) for parameters ``names``."""
    state = {"state": {n: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)} for n in names},
             "param_groups": [{"lr": lr, "betas": (0.9, 0.999), "params": names}]}
    return {"model": encode(state, "optimizer/model", {})}


def test_the_union_of_identical_optimizer_structures_is_any_one_of_them():
    """Ranks holding shards of the same parameters (fsdp) give the same structure."""
    one = encoded(["0.weight", "0.bias", "2.weight"])
    assert merged_optimizers([copy.deepcopy(one) for _ in range(4)]) == one


def test_the_union_of_the_stages_optimizer_structures_is_the_whole_models():
    """Two replicas of two stages; a parameter both stages hold (tied) is named once."""
    first, second = encoded(["0.weight", "0.bias", "tied"]), encoded(["4.weight", "tied"])
    merged = merged_optimizers([first, first, second, second])["model"]
    assert merged["param_groups"] == [{"lr": 0.01, "betas": {"__tuple__": [0.9, 0.999]},
                                       "params": ["0.weight", "0.bias", "tied", "4.weight"]}]
    assert list(merged["state"]) == ["0.weight", "0.bias", "tied", "4.weight"]
    assert sorted(references(merged)) == sorted(
        f"optimizer/model/state/{n}/{field}" for n in ["0.weight", "0.bias", "tied", "4.weight"]
        for field in ("step", "exp_avg"))
    assert first == encoded(["0.weight", "0.bias", "tied"])  # the inputs are left alone


def test_a_storage_read_of_some_keys_leaves_the_rest_unread_and_refuses_their_use(tmp_path):
    from mpt.checkpoint import sharded

    saved = {"model/model/0.weight": torch.arange(6.0).view(2, 3),
             "model/model/4.weight": torch.ones(3), "optimizer/model/state/4.weight/step":
             torch.tensor(2.0)}
    sharded.save(saved, str(tmp_path))
    into = {"model/model/0.weight": torch.zeros(2, 3)}
    got = sharded.load(str(tmp_path), into, whole={"optimizer/model/state/4.weight/step",
                                                   "not/in/the/checkpoint"})
    assert got.keys() == saved.keys()
    assert got["model/model/0.weight"] is into["model/model/0.weight"]  # read in place
    assert torch.equal(into["model/model/0.weight"], saved["model/model/0.weight"])
    assert torch.equal(got["optimizer/model/state/4.weight/step"], torch.tensor(2.0))
    unread = got["model/model/4.weight"]
    assert isinstance(unread, sharded.Unread)
    for use in (lambda: unread.to("cpu"), lambda: torch.add(torch.ones(3), unread),
                lambda: unread.shape, lambda: copy.deepcopy(unread)):
        with pytest.raises(CheckpointError, match=r"did not read model/model/4\.weight"):
            use()
    everything = sharded.load(str(tmp_path), {})
    assert all(torch.equal(everything[key], t) for key, t in saved.items())
