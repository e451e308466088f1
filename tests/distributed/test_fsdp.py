"""The fsdp backend (torch's fully_shard) on real processes: 2 ranks, gloo, CPU, started by
`mpt launch`. Training like ddp at every precision and shape is the conformance grid's job
(tests/conformance); here: the sharding itself, accumulation, clipping over shards, and an
fp16 overflow that only one rank's shard holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from common import reference_params
from conftest import run_mpt, worker
from test_ddp import MICRO, STEPS, launch_equivalence


def launch_checks(tmp_path: Path, port: int, mode: str, *options: str) -> list[dict]:
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(port), "--backend", "fsdp",
                     *options, worker("fsdp_checks.py"), str(tmp_path), mode)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize(("accumulate", "meta", "offload"), [
    (1, False, ()), (3, True, ()),
    # accumulated in host memory (a layout `mpt plan` ranks)
    pytest.param(3, False, ("--fsdp-cpu-offload",), id="3-offload", marks=pytest.mark.slow)])
def test_fsdp_matches_one_process_on_the_concatenated_batches(tmp_path, free_port, accumulate,
                                                              meta, offload):
    """``meta``: the model is built on the meta device; each unit is initialised as the CPU
    would have (rank 0's random state, reset_parameters in module order), then sharded."""
    ranks = launch_equivalence(tmp_path, free_port, accumulate, "--backend", "fsdp",
                               "--fsdp-wrap", "Linear", *offload, meta=meta)
    reference = reference_params(STEPS, 2 * accumulate * MICRO)
    for r in ranks:
        for got, want in zip(r["params"], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert ranks[0]["stepped"] == ([False] * (accumulate - 1) + [True]) * STEPS


@pytest.mark.parametrize("offload", [pytest.param((), id="on-device"), pytest.param(
    ("--fsdp-cpu-offload",), id="cpu-offload", marks=pytest.mark.slow)])
def test_each_rank_holds_half_and_clipping_sees_the_whole_gradient(tmp_path, free_port, offload):
    ranks = launch_checks(tmp_path, free_port, "clip", "--fsdp-wrap", "Linear", *offload)
    # every Linear is a unit of its own, the model the root of the rest
    assert ranks[0]["units"] == ["", "0", "2"]
    assert sum(r["local_numel"] for r in ranks) == ranks[0]["numel"]
    assert ranks[0]["local_numel"] < ranks[0]["numel"]
    for r in ranks:
        # the norm of the whole gradient, reduced over both shards, before clipping
        assert r["norms"] == pytest.approx(r["plain_norms"], rel=1e-5)
        assert min(r["plain_norms"]) > 0.05  # clipping was active at every step
        assert r["max_diff"] < 1e-6


def test_an_fp16_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path, free_port):
    ranks = launch_checks(tmp_path, free_port, "overflow", "--precision", "fp16-mixed")
    assert [r["shard_rows"] for r in ranks] == [4, 4]
    for r in ranks:
        assert r["stepped"] == [True, True, False, True]
        assert r["scales"] == [1024.0, 1024.0, 512.0, 512.0]
    # neither shard moved at the skipped step
    for r in ranks:
        assert r["rows"][2] == r["rows"][1] and r["rows"][3] != r["rows"][2]


def test_other_backends_refuse_a_model_on_the_meta_device_in_one_line(tmp_path, free_port):
    result = run_mpt("launch", "--gpus", "1", "--master-port", str(free_port),
                     worker("equivalence.py"), str(tmp_path), "1", "4", "1", "meta")
    assert result.returncode == 2
    assert ("mpt: error: model=Sequential is invalid: it is on the meta device, and --backend "
            "ddp needs its weights. Fix: build it on the CPU, or use --backend fsdp"
            ) in result.stderr and "--pipeline-stages" in result.stderr


@pytest.mark.parametrize(("precision", "low", "norm", "kept"), [
    ("O2", "torch.float16", "torch.float32", "torch.float32"),
    ("O3", "torch.float16", "torch.float16", "torch.float16"),
    pytest.param("O2-bf16", "torch.bfloat16", "torch.float32", "torch.float32",
                 marks=pytest.mark.slow)])
def test_a_cast_precision_gathers_cast_weights_and_steps_its_masters(tmp_path, free_port,
                                                                    precision, low, norm, kept):
    """O2: fp32 shards are the masters, each unit gathers them cast (MixedPrecisionPolicy),
    batch norm stays fp32 in a unit of its own; O3: the cast model itself is sharded."""
    ranks = launch_checks(tmp_path, free_port, "cast", "--precision", precision)
    for r in ranks:
        assert r["seen"] == {"0": [low, low], "1": [norm, low], "3": [low, low]}
        assert r["output"] == "torch.float32"  # Apex's cast of the model's outputs
        assert r["weights"] == [f"DTensor {kept}"] and r["grads"] == [kept]
        assert "master_params" not in r["precision_state"]  # the shards are the masters
        assert r["losses"][-1] < r["losses"][0]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # each rank's loss of the same batch
