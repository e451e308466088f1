"""``ParallelPlan``: the rank arithmetic of every axis, without starting a process."""

from __future__ import annotations

import pytest

from mpt.errors import UsageError
from mpt.parallel import ParallelPlan


def test_ranks_unfold_tp_fastest_then_shard_replicate_and_stage():
    plan = ParallelPlan(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    assert plan.world_size == 16 and plan.dp_size == 4
    assert plan.coords(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 0}
    assert plan.coords(13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 1}
    assert all(plan.rank_at(**plan.coords(r)) == r for r in range(16))
    assert plan.groups("tp")[0] == [0, 1] and plan.groups("pp")[0] == [0, 8]
    assert sorted(map(sorted, plan.groups("dp_shard")))[0] == [0, 2]
    # every rank reads one of dp_size shards, and each shard is read by pp x tp ranks
    readers = [plan.dp_rank(r) for r in range(16)]
    assert sorted(set(readers)) == [0, 1, 2, 3] and all(readers.count(d) == 4 for d in range(4))


def test_a_pipeline_keeps_the_layout_it_always_had():
    """Rank r is stage r // D of replica r % D."""
    plan = ParallelPlan.for_world(8, pp=2)
    assert (plan.pp, plan.dp_replicate) == (2, 4)
    assert [(plan.stage(r), plan.dp_rank(r)) for r in range(8)] == [
        (r // 4, r % 4) for r in range(8)]


def test_the_data_axis_is_the_backends_and_takes_what_is_left():
    assert ParallelPlan.for_world(4, data_axis="dp_shard") == ParallelPlan(dp_shard=4)
    assert ParallelPlan.for_world(8, pp=2, tp=2) == ParallelPlan(pp=2, dp_replicate=2, tp=2)


def test_a_world_the_model_axes_do_not_divide_is_refused_naming_the_flag():
    with pytest.raises(UsageError, match=r"--pipeline-stages=3 .*pass --pipeline-stages one "
                                         r"of 1, 2, 4, 8"):
        ParallelPlan.for_world(8, pp=3)
    with pytest.raises(UsageError, match="--tensor-parallel=3"):
        ParallelPlan.for_world(8, pp=2, tp=3)
    with pytest.raises(UsageError, match="--pipeline-stages=0"):
        ParallelPlan(pp=0)


def test_the_data_dims_are_both_axes_under_hsdp():
    assert ParallelPlan(dp_replicate=2, dp_shard=2).data_dims == ("dp_replicate", "dp_shard")
    assert ParallelPlan(pp=2, dp_shard=2).data_dims == ("dp_shard",)
    assert ParallelPlan(pp=2).data_dims == ("dp_shard",)  # one rank: either axis serves


def test_fsdp_replicate_splits_the_data_ranks_into_hsdp_groups():
    from mpt.run_config import RunConfig

    run = RunConfig(backend="fsdp", backend_options={"replicate": 2})
    assert run.layout(8) == ParallelPlan(dp_replicate=2, dp_shard=4)
    piped = RunConfig(backend="fsdp", backend_options={"replicate": 2}, pipeline_stages=2)
    assert piped.layout(8) == ParallelPlan(pp=2, dp_replicate=2, dp_shard=2)
    with pytest.raises(UsageError, match=r"--fsdp-replicate=8 .*one rank per shard group"):
        run.replace(backend_options={"replicate": 8}).layout(8)
    with pytest.raises(UsageError, match=r"--fsdp-replicate=3 .*pass one of 1, 2, 4"):
        RunConfig(backend="fsdp", backend_options={"replicate": 3}).layout(4)


def test_stage_counts_in_order_of_preference_give_each_world_the_first_that_divides():
    from mpt.run_config import RunConfig

    run = RunConfig.parse({"backend": "fsdp", "pipeline_stages": "2,1"})
    assert run.pipeline_stages == (2, 1)
    assert run.layout(4) == ParallelPlan(pp=2, dp_shard=2) and run.pipeline_at(4).stages == 2
    assert run.layout(3) == ParallelPlan(dp_shard=3) and run.pipeline_at(3) is None
    assert RunConfig(pipeline_stages=2).pipeline_stages == (2,)  # a count given in code
    with pytest.raises(UsageError, match=r"--pipeline-stages=3 .*pass --pipeline-stages one of"):
        RunConfig.parse({"pipeline_stages": "3"}).layout(4)
    for value, words in (("2,2", "listed twice"), ("2,0", "at least 1"), ("2,x", "whole")):
        with pytest.raises(UsageError, match=rf"--pipeline-stages={value} .*{words}"):
            RunConfig.parse({"pipeline_stages": value})
    with pytest.raises(UsageError, match=r"--pipeline-split=h.1 .*lists 2,1"):
        RunConfig.parse({"backend": "fsdp", "pipeline_stages": "2,1", "pipeline_split": "h.1"})


def test_describe_names_the_axes_in_use():
    assert ParallelPlan(pp=2, dp_replicate=3).describe() == (
        "2 pipeline stage(s) x 3 data-parallel replica(s)")
    assert ParallelPlan().describe() == "1 process"
