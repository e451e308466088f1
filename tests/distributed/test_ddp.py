"""The ddp backend on real processes: 2 ranks, gloo, CPU, started by `mpt launch` (the fp16
overflow case also under apex and horovod)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from common import reference_params
from conftest import run_mpt, worker

STEPS, MICRO = 6, 4


def launch_equivalence(tmp_path: Path, port: int, accumulate: int, *options: str,
                       gpus: int = 2, meta: bool = False) -> list[dict]:
    result = run_mpt("launch", "--gpus", str(gpus), "--master-port", str(port), *options,
                     worker("equivalence.py"), str(tmp_path), str(STEPS), str(MICRO),
                     str(accumulate), *(["meta"] if meta else []))
    assert result.returncode == 0, result.stderr
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(gpus)]


@pytest.mark.parametrize("accumulate", [1, 3])
def test_ddp_matches_one_process_on_the_concatenated_batches(tmp_path, free_port, accumulate):
    ranks = launch_equivalence(tmp_path, free_port, accumulate)
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world_size"] == 2
    reference = reference_params(STEPS, 2 * accumulate * MICRO)
    for r in ranks:
        for got, want in zip(r["params"], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for got0, got1 in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(got0, got1)  # replicas stay bitwise identical
    # one optimizer step per `accumulate` micro-batches ...
    assert ranks[0]["stepped"] == ([False] * (accumulate - 1) + [True]) * STEPS
    # ... and one allreduce per step (the model fits one bucket): none on the first k-1.
    assert ranks[0]["allreduces"] == STEPS


@pytest.mark.parametrize("backend", ["ddp", "apex", "horovod"])
def test_fp16_overflow_on_one_rank_skips_that_step_everywhere(tmp_path, free_port, backend):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--backend",
                     backend, "--precision", "fp16-mixed", worker("fp16_overflow.py"),
                     str(tmp_path))
    assert result.returncode == 0, result.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert [e["stepped"] for e in r["log"]] == [True, True, True, False, True, True]
        scales = [e["scale"] for e in r["log"]]
        assert scales[:3] == [1024.0] * 3 and scales[3:] == [512.0] * 3
        assert r["saved"]["skipped_steps"] == 1
        # the scaler state came back from the checkpoint after being spoilt
        assert r["restored"] == r["saved"] and r["extra"] == {"step": 6}
    for p0, p1 in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(p0, p1) and torch.isfinite(p0).all()


@pytest.mark.gpu
def test_ddp_on_gpus_with_nccl_matches_one_process(tmp_path, free_port):
    gpus = min(2, torch.cuda.device_count())
    ranks = launch_equivalence(tmp_path, free_port, accumulate=2, gpus=gpus)
    reference = reference_params(STEPS, gpus * 2 * MICRO)
    for r in ranks:
        for got, want in zip(r["params"], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # TF32/cuBLAS order


@pytest.mark.gpu
def test_a_model_the_script_spread_over_two_gpus_trains_under_ddp(tmp_path, free_port):
    """The seeds' pattern: each process's model in two halves on two GPUs, wrapped by DDP with
    device_ids=None; mpt leaves the halves where they are. One process per pair of GPUs, two
    processes at least (one alone is not wrapped in DDP)."""
    pairs = torch.cuda.device_count() // 2
    if pairs < 2:
        pytest.skip(f"needs 4 CUDA devices (two processes of two); {torch.cuda.device_count()} "
                    "visible")
    result = run_mpt("launch", "--gpus", str(pairs), "--master-port", str(free_port),
                     worker("model_parallel.py"), str(tmp_path / "out.json"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "out.json").read_text())["diff"] < 1e-5
