"""--global-batch-size and --lr-scaling: the arithmetic, its errors, and a real 2-rank job."""

from __future__ import annotations

import json
import math

import pytest
from conftest import run_mpt, worker

from mpt.errors import UsageError
from mpt.scaling import BatchPlan, lr_factor, plan_batch


@pytest.mark.parametrize(("total", "world", "kwargs", "batch", "accumulate"), [
    (256, 4, {"batch_size": 32}, 32, 2),        # micro-batch given: accumulation follows
    (256, 4, {}, 64, 1),                        # nothing given: no accumulation
    (256, 4, {"accumulate": 4}, 16, 4),         # accumulation given: micro-batch follows
    (256, 4, {"batch_size": 16, "accumulate": 4}, 16, 4),  # both, consistent
    ("8", 1, {"batch_size": 8}, 8, 1),          # as it arrives from the launch flag
])
def test_global_batch_splits_into_ranks_micro_batches_and_accumulation(total, world, kwargs,
                                                                      batch, accumulate):
    plan = plan_batch(total, world, **kwargs)
    assert plan == BatchPlan(global_batch_size=int(total), world_size=world, batch_size=batch,
                             accumulate=accumulate)
    assert plan.world_size * plan.batch_size * plan.accumulate == plan.global_batch_size


@pytest.mark.parametrize(("total", "world", "kwargs", "words"), [
    (100, 8, {}, ["--global-batch-size=100", "multiple of world size x accumulation = 8 x 1",
                  "96 or 104"]),
    (256, 4, {"batch_size": 24}, ["multiple of world size x batch size = 4 x 24 = 96"]),
    (256, 4, {"batch_size": 16, "accumulate": 2}, ["4 x 16 x 2 = 128", "only one of"]),
    (3, 4, {}, ["pass --global-batch-size 4"]),
    (0, 1, {}, ["at least 1"]),
    ("many", 1, {}, ["--global-batch-size=many"]),
])
def test_impossible_global_batch_is_one_usage_error(total, world, kwargs, words):
    with pytest.raises(UsageError) as info:
        plan_batch(total, world, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_lr_scaling_rules():
    assert lr_factor("linear", 8) == 8.0
    assert lr_factor("sqrt", 8) == pytest.approx(math.sqrt(8))
    assert lr_factor(None, 8) == 1.0
    with pytest.raises(UsageError, match="--lr-scaling=cubic"):
        lr_factor("cubic", 8)


def test_two_ranks_get_the_derived_batch_and_scaled_lr_and_rank0_says_so(tmp_path, free_port):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port),
                     "--global-batch-size", "16", "--lr-scaling", "sqrt",
                     worker("batch_knobs.py"), str(tmp_path), "4")
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["batch_size"] == 4 and got["accumulate"] == 2 and got["first_batch"] == 4
        assert got["lr"] == pytest.approx(0.1 * math.sqrt(2))
        assert "DataLoader batch_size=5 is invalid" in got["refused"]
        assert "batch_size=rt.batch_size" in got["refused"]
        assert (got["eval_batch"], got["eval_name"]) == (10, "loader1")
    lines = result.stdout.splitlines()
    plan = "mpt: global batch 16 = 2 process(es) x 4 per micro-batch x 2 accumulation step(s)"
    assert lines.count(f"[rank0]: {plan}") == 1, result.stdout  # rank 0 only
    assert sum("lr scaling sqrt" in line and "by 1.41421" in line for line in lines) == 1


def test_launch_refuses_a_global_batch_the_world_cannot_split(tmp_path):
    result = run_mpt("launch", "--gpus", "4", "--global-batch-size", "30", "--dry-run",
                     worker("batch_knobs.py"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--global-batch-size=30" in result.stderr
