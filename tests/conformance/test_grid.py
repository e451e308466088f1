"""The conformance grid's fast subset, and checks of the instrument itself.

`make conformance` (tests/conformance/grid.py) runs every backend x precision x world size x
accumulation, every backend x gradient compression, and the pipeline rows; here: each backend
once in mixed precision at 2 ranks with accumulation 2, DeepSpeed's communication dtype (the
compression no other fast test trains), one pipeline cell, pairs that must be refused before
start, and the judging rules on plain-torch runs (no launch).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from conformance_model import GLOBAL_BATCH, RECIPE_OF, STEPS, plain_run
from grid import make_reference, run_cell
from judge import (
    PLANTED,
    PRECISIONS,
    Cell,
    Run,
    judge_refusal,
    judge_run,
    measure_baseline,
    worst_of_dtype,
)

MIXED = [p for p in PRECISIONS if RECIPE_OF[p] != "fp32"]


# -- the instrument, without launching anything ---------------------------------------------------

def schedule(micro_batches: int) -> list[list[list[int]]]:
    """A shuffled epoch cut into STEPS steps of ``micro_batches`` micro-batches each."""
    order = torch.randperm(STEPS * GLOBAL_BATCH, generator=torch.Generator().manual_seed(3))
    size = GLOBAL_BATCH // micro_batches
    return [[order[(s * micro_batches + k) * size:(s * micro_batches + k + 1) * size].tolist()
             for k in range(micro_batches)] for s in range(STEPS)]


def as_run(plain, micro) -> Run:
    return Run(losses=plain.losses, schedule=micro, params=plain.params,
               stepped=[True] * STEPS, off_boundary_steps=0)


@pytest.fixture(scope="module")
def plain_2x2():
    micro = schedule(4)
    return micro, as_run(plain_run("fp32", micro), micro), measure_baseline(micro)


@pytest.mark.parametrize("precision", MIXED)
def test_tolerances_pass_correct_mixed_training_and_fail_its_usual_bugs(plain_2x2, precision):
    """The plain recipe of the precision passes; the same recipe with a planted bug (a gradient
    summed over the 4 micro-batches instead of averaged, halved, 10 % too small, one update in
    ten lost) fails; so does fp32 presented as mixed precision."""
    micro, reference, baseline = plain_2x2
    cell = Cell("plain", precision, 2, 2)
    limits = worst_of_dtype(baseline, precision)

    def verdict(run: Run) -> str:
        outcome = judge_run(cell, run, reference, limits, 0.0)
        return outcome.verdict + " " + outcome.detail

    assert verdict(as_run(plain_run(RECIPE_OF[precision], micro), micro)).startswith("P ")
    for bug, wrong in PLANTED.items():
        got = verdict(as_run(plain_run(RECIPE_OF[precision], micro, **wrong), micro))
        assert got.startswith("F deviates"), (bug, got)
    assert "not applied" in verdict(reference)


def test_the_reference_loop_matches_plain_fp32_in_any_order_of_micro_batches():
    one, four = schedule(1), schedule(4)
    a, b = plain_run("fp32", one), plain_run("fp32", four)
    assert a.losses != b.losses  # batch norm sees other batches: a different job
    assert a.losses[-1] < 0.6 * a.losses[0] and b.losses[-1] < 0.6 * b.losses[0]


def refusal(stderr: str, started: int, tmp_path: Path, seconds: float = 1.0) -> str:
    out = Path(tempfile.mkdtemp(dir=tmp_path))  # the cell's own output folder
    for k in range(started):
        (out / f"started-{k}").touch()
    result = subprocess.CompletedProcess([], 2, "", stderr)
    outcome = judge_refusal(Cell("horovod", "O2-bf16", 2, 2), result, out, seconds)
    return outcome.verdict + " " + outcome.detail


def test_a_refusal_is_one_line_before_start_naming_backend_and_precision(tmp_path):
    line = "mpt: --precision O2-bf16 is invalid for backend horovod: no bf16 tensors\n"
    assert refusal(line, 0, tmp_path).startswith("R ")
    assert "started" in refusal(line, 2, tmp_path)
    assert "traceback" in refusal("Traceback (most recent call last):\n" + line, 0, tmp_path)
    assert "2 lines" in refusal("a note\n" + line, 0, tmp_path)
    assert "does not name" in refusal("mpt: refused\n", 0, tmp_path)
    # judged by the marker files, not the clock: a refusal took 35 s on a loaded machine
    assert refusal(line, 0, tmp_path, seconds=60.0).startswith("R ")


def test_a_compression_refusal_names_backend_and_compression(tmp_path):
    cell = Cell("horovod", "fp32", 2, 2, compression="bf16")
    result = subprocess.CompletedProcess([], 2, "", "mpt: --grad-compression=bf16 is invalid: "
                                         "--backend horovod has no bf16 tensors to allreduce\n")
    assert judge_refusal(cell, result, tmp_path, 1.0).verdict == "R"
    vague = subprocess.CompletedProcess([], 2, "", "mpt: --backend horovod refused fp32\n")
    assert "does not name backend and compression" in judge_refusal(cell, vague, tmp_path,
                                                                      1.0).detail


# -- the fast subset of the grid: real launches ------------------------------------------------

@pytest.fixture(scope="module")
def reference_2x2():
    reference = make_reference(2, 2)
    assert reference.outcome.verdict == "P", reference.outcome.detail  # vs plain torch fp32
    return reference


@pytest.mark.parametrize(("backend", "precision"), [
    ("ddp", "bf16-mixed"), ("apex", "O2"), ("horovod", "fp16-mixed"),
    ("deepspeed", "bf16-mixed"), ("fsdp", "fp16-mixed"), ("fsdp", "O2")])
def test_each_backend_trains_a_mixed_precision_like_ddp_fp32(reference_2x2, backend, precision):
    outcome, _ = run_cell(Cell(backend, precision, 2, 2), reference_2x2)
    assert outcome.verdict == "P", outcome.detail


@pytest.mark.parametrize(("backend", "compression"), [
    ("deepspeed", "bf16"),
    # slow: ddp's PowerSGD is checked bit for bit against torch's hook in make test
    # (tests/backends/test_grad_comm.py), and Horovod's fp16 is the compressor it always had
    pytest.param("horovod", "fp16", marks=pytest.mark.slow),
    pytest.param("ddp", "powersgd", marks=pytest.mark.slow)])
def test_a_compression_trains_like_the_uncompressed_run(reference_2x2, backend, compression):
    outcome, _ = run_cell(Cell(backend, "fp32", 2, 2, compression=compression), reference_2x2)
    assert outcome.verdict == "P", outcome.detail


def test_a_pipeline_trains_a_mixed_precision_like_its_fp32_reference():
    """The pipeline row's fast cell: 2 stages, fsdp over each stage's replica, accumulation 2,
    against ddp fp32 at 2 stages (itself checked against plain torch on the micro-batches the
    schedule ran)."""
    reference = make_reference(1, 2, stages=2)
    assert reference.outcome.verdict == "P", reference.outcome.detail
    outcome, _ = run_cell(Cell("fsdp", "fp16-mixed", 1, 2, stages=2), reference)
    assert outcome.verdict == "P", outcome.detail


@pytest.fixture(scope="module")
def reference_4x2():
    reference = make_reference(4, 2)
    assert reference.outcome.verdict == "P", reference.outcome.detail  # vs plain torch fp32
    return reference


@pytest.mark.parametrize("precision", [
    "bf16-mixed", *(pytest.param(p, marks=pytest.mark.slow)
                    for p in ("fp32", "fp16-mixed", "O1", "O2", "O3", "O2-bf16"))])
def test_hsdp_trains_like_ddp_fp32_at_four_processes(reference_4x2, precision):
    """The HSDP axis (2 replicas x 2 shards, accumulation 2) in the grid's judgement: against
    ddp fp32 on the same 4 processes (batch norm sees each rank's micro-batch)."""
    outcome, _ = run_cell(Cell("fsdp", precision, 4, 2, replicate=2), reference_4x2)
    assert outcome.verdict == "P", outcome.detail


@pytest.mark.parametrize(("backend", "precision", "stages"), [
    ("ddp", "bf16-mixed", 1),
    *(pytest.param(*cell, marks=pytest.mark.slow) for cell in (
        ("ddp", "fp16-mixed", 1), ("fsdp", "bf16-mixed", 1), ("fsdp", "fp16-mixed", 1),
        ("ddp", "fp32", 2), ("fsdp", "bf16-mixed", 2)))])
def test_tensor_parallel_trains_like_ddp_fp32(backend, precision, stages):
    """The tp axis (the head's classes over 2 ranks, accumulation 2) in the grid's judgement:
    against ddp fp32 at the same data-parallel size and pipeline stages."""
    reference = make_reference(1, 2, stages=stages)
    assert reference.outcome.verdict == "P", reference.outcome.detail
    outcome, _ = run_cell(Cell(backend, precision, 1, 2, stages=stages, tp=2), reference)
    assert outcome.verdict == "P", outcome.detail


REFUSED = [("horovod", "O2-bf16")]  # Horovod has no bf16 tensors to allreduce
if not torch.cuda.is_available():
    REFUSED.append(("deepspeed", "fp16-mixed"))  # DeepSpeed refuses fp16 on a CPU


@pytest.mark.parametrize(("backend", "precision"), REFUSED)
def test_a_pair_that_cannot_train_is_refused_before_start(backend, precision):
    outcome, _ = run_cell(Cell(backend, precision, 2, 2), None)
    assert outcome.verdict == "R", outcome.detail
