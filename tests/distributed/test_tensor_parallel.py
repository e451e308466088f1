"""Tensor parallelism (``--tensor-parallel T``) on real gloo processes: examples/gpt.py's GPT
split over the tp ranks trains as the same loop in plain torch on one process, alone and
beside the data axes (ddp, fsdp, HSDP) and pipeline stages; its checkpoints resume under
another layout; bad layouts and plans are refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from conftest import run_mpt, worker
from tensor_parallel import make_model, reference

STEPS = 4


def train(tmp_path: Path, port: int, gpus: int, *options: str, args: tuple[str, ...] = (),
          name: str = "out.json", timeout: float = 240) -> dict:
    out = tmp_path / name
    result = run_mpt("launch", "--gpus", str(gpus), "--master-port", str(port), *options,
                     worker("tensor_parallel.py"), str(out), "--steps", str(STEPS), *args,
                     timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    found["losses"] = {int(k): v for k, v in found["losses"].items()}
    return found


def assert_on_curve(losses: dict[int, float], want: list[float], rtol: float = 1e-5) -> None:
    for step, loss in losses.items():
        assert loss == pytest.approx(want[step - 1], rel=rtol), (step, losses, want)


def test_tp2_matches_one_process_holds_half_and_resumes_at_one_process(tmp_path, free_port):
    want = reference(STEPS)
    ckpt = tmp_path / "ckpt"
    found = train(tmp_path, free_port, 2, "--tensor-parallel", "2",
                  args=("--save-at", "2", "--ckpt", str(ckpt)))
    assert sorted(found["losses"]) == [1, 2, 3, 4]
    assert_on_curve(found["losses"], want)
    model = make_model()
    split = sum(param.numel() for name, style in model.tensor_parallel_plan().items()
                for kind, param in model.get_submodule(name).named_parameters()
                if style != "rowwise" or kind == "weight")  # a rowwise bias stays whole
    share = found["whole"] - split + split // 2  # the planned layers' half, the rest whole
    for rank in found["held"]:  # parameters and Adam's two moments
        assert rank["params"] == share and rank["state"] == 2 * share, rank
    assert share <= 0.55 * found["whole"]
    # tp ranks keep the weights they both hold (embeddings, output norm) equal
    assert found["held"][0]["whole_sum"] == found["held"][1]["whole_sum"]
    # saved in pieces: each rank wrote its shards of the split layers, none gathered them all
    sizes = [shard.stat().st_size for shard in ckpt.rglob("shard-*.safetensors")]
    assert len(sizes) == 2 and max(sizes) < 0.8 * sum(sizes), sizes
    # saved at tp 2, resumed by one process without tensor parallelism: the same curve
    resumed = train(tmp_path, free_port, 1, args=("--resume", str(ckpt)), name="resumed.json")
    assert sorted(resumed["losses"]) == [3, 4]
    assert_on_curve(resumed["losses"], want)


@pytest.mark.slow
@pytest.mark.parametrize(("gpus", "options"), [
    (4, ("--backend", "ddp")),                                          # tp 2 x ddp 2
    (4, ("--backend", "fsdp")),                                         # fsdp 2 x tp 2 (2-D)
    (4, ("--backend", "ddp", "--pipeline-stages", "2")),                # pp 2 x tp 2
    (8, ("--backend", "fsdp", "--pipeline-stages", "2")),               # pp 2 x fsdp 2 x tp 2
    (8, ("--backend", "fsdp", "--fsdp-replicate", "2")),                # HSDP 2 x 2 x tp 2
], ids=["ddp", "fsdp", "pp2", "pp2-fsdp", "hsdp"])
def test_tp2_beside_other_axes_matches_one_process(tmp_path, free_port, gpus, options):
    found = train(tmp_path, free_port, gpus, "--tensor-parallel", "2", *options, timeout=420)
    assert_on_curve(found["losses"], reference(STEPS))
    if options == ("--backend", "fsdp"):  # split over tp, then sharded over dp: about a quarter
        for rank in found["held"]:
            assert rank["params"] <= 0.30 * found["whole"], rank


@pytest.mark.slow
def test_a_checkpoint_of_fsdp_x_tp_resumes_under_tp_and_ddp(tmp_path, free_port):
    want = reference(STEPS)
    ckpt = tmp_path / "ckpt"
    train(tmp_path, free_port, 4, "--tensor-parallel", "2", "--backend", "fsdp",
          args=("--save-at", "2", "--ckpt", str(ckpt)))
    resumed = train(tmp_path, free_port, 2, "--tensor-parallel", "2",
                    args=("--resume", str(ckpt)), name="tp.json")
    assert_on_curve(resumed["losses"], want)
    resumed = train(tmp_path, free_port, 2, args=("--resume", str(ckpt)), name="ddp.json")
    assert_on_curve(resumed["losses"], want)


@pytest.mark.slow
def test_sequence_parallel_norms_train_as_one_process(tmp_path, free_port):
    found = train(tmp_path, free_port, 2, "--tensor-parallel", "2",
                  args=("--sequence-parallel",))
    assert_on_curve(found["losses"], reference(STEPS, sequence=True))


@pytest.mark.slow
def test_bf16_mixed_tp2_follows_the_fp32_curve(tmp_path, free_port):
    found = train(tmp_path, free_port, 2, "--tensor-parallel", "2", "--precision", "bf16-mixed")
    assert_on_curve(found["losses"], reference(STEPS), rtol=2e-2)


def test_fp16_overflow_on_one_tp_rank_skips_the_step_on_both(tmp_path, free_port):
    found = train(tmp_path, free_port, 2, "--tensor-parallel", "2", "--precision",
                  "fp16-mixed", "--loss-scale", "dynamic", args=("--overflow-at", "2"))
    first, second = found["held"]
    assert first["skipped"] == second["skipped"] == 1
    assert first["scale"] == second["scale"]
    assert first["whole_sum"] == second["whole_sum"]  # the weights both hold stepped alike


def test_dry_run_places_tp_innermost_and_bad_layouts_are_one_line(tmp_path):
    plan = run_mpt("launch", "--nodes", "2", "--nr", "0", "--master-addr", "127.0.0.1",
                   "--gpus", "2", "--tensor-parallel", "2", "--pipeline-stages", "2",
                   "--dry-run", worker("tensor_parallel.py"), "out")
    assert plan.returncode == 0, plan.stderr
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in plan.stdout.splitlines() if line.startswith("│")]
    # node, local rank, global rank, stage, tp rank: a tp group is one node's processes
    assert [row[:5] for row in rows] == [["0", "0", "0", "0", "0"], ["0", "1", "1", "0", "1"],
                                         ["1", "0", "2", "1", "0"], ["1", "1", "3", "1", "1"]]
    assert "layout: 2 pipeline stage(s) x 2 tensor-parallel rank(s)" in plan.stdout
    for options, expected in [
        (("--gpus", "4", "--tensor-parallel", "3"), "--tensor-parallel=3"),
        (("--gpus", "2", "--nodes", "2", "--nr", "0", "--master-addr", "127.0.0.1",
          "--tensor-parallel", "4"), "within one node"),
        (("--gpus", "2", "--tensor-parallel", "2", "--backend", "deepspeed"),
         "use --backend ddp or fsdp"),
        (("--gpus", "2", "--tensor-parallel", "2", "--precision", "O2"), "--precision=O2"),
    ]:
        result = run_mpt("launch", *options, "--dry-run", worker("tensor_parallel.py"), "out")
        assert result.returncode == 2, (options, result.stderr)
        assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr


def test_a_model_without_a_plan_is_refused_in_one_line_at_setup(tmp_path, free_port):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port),
                     "--tensor-parallel", "2", worker("tensor_parallel.py"),
                     str(tmp_path / "out.json"), "--no-plan")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "mpt: error" in line]
    assert lines and "GPT declares no tensor-parallel plan" in lines[0], result.stderr
    assert "add a method tensor_parallel_plan()" in lines[0]
