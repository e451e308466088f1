"""`--accumulate` without a pipeline in `mpt plan`: the micro-batches' compute, one
micro-batch's activations and data, the gradients reduced once in the last backward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from plan_models import mlp, normed

from mpt.backends import get_backend
from mpt.estimate import meta_model
from mpt.plan.cost import predict
from mpt.plan.layouts import layout, layouts
from mpt.plan.network import Cluster
from mpt.plan.planner import model_of, plan
from mpt.plan.profiles import device_profile, link_profile
from mpt.precision import describe

LARGEST = 4096 * 4096 * 4  # the MLP's largest weight, fp32


def _cluster(**device) -> Cluster:
    return Cluster(nodes=2, gpus=1, device=replace(device_profile("h100-sxm"), **device),
                   link=link_profile("1gbit"))


def test_accumulation_is_a_layout_where_the_backend_prices_it() -> None:
    """Each --accumulate of 1, 2, 4 and 8 that splits a replica's batch, for every backend
    and ZeRO stage; not DeepSpeed's offloaded optimizer, which accumulates on the host."""
    found, _ = layouts(meta_model(mlp), nodes=2, gpus=1, precision="fp32", batch=8,
                       device_type="cuda")
    counts: dict[str, set[int]] = {}
    for chosen in found:
        if chosen.plan.pp == 1 and chosen.comm.compression == "none":
            name = chosen.backend + str(chosen.options.get("zero_stage", ""))
            counts.setdefault(name, set()).add(chosen.microbatches)
    for name in ("ddp", "apex", "horovod", "fsdp", *(f"deepspeed{z}" for z in range(4))):
        assert counts[name] == {1, 2, 4}, name  # 4 samples a replica
    offloaded = {c.microbatches for c in found if c.options.get("offload")}
    assert offloaded == {1}
    flags = {c.label for c in found if c.backend == "ddp" and c.plan.pp == 1}
    assert "--backend ddp --accumulate 4" in flags


def test_accumulated_micro_batches_cost_their_compute_and_hold_one_at_a_time() -> None:
    net = meta_model(mlp)
    model = model_of(net, [1024], torch.float32, "adam")
    whole, split = (predict(layout(net, "ddp", {}, 1, 1, world=2, precision="fp32", batch=512,
                                   accumulate=a), model, _cluster(), describe("fp32"))
                    for a in (1, 4))
    assert split.layout.micro_batch == 64 and split.layout.microbatches == 4
    # four forwards and backwards of 64 rows: the 256 rows' work (more per row: smaller
    # matmuls), the optimizer once
    assert split.terms["forward"] >= whole.terms["forward"]
    assert split.terms["optimizer step"] == whole.terms["optimizer step"]
    # one micro-batch's activations and data; the later gradients made anew beside
    assert split.memory.activations == pytest.approx(whole.memory.activations / 4, rel=0.01)
    assert split.memory.batch == whole.memory.batch / 4 == 64 * 1024 * 4
    assert (whole.memory.accumulating, split.memory.accumulating) == (0, LARGEST)
    # the same allreduce a step, hidden only behind the last micro-batch's backward
    assert split.link_bytes == whole.link_bytes
    assert split.hidden < whole.hidden


def test_a_batch_that_does_not_fit_whole_fits_accumulated() -> None:
    """With room for one micro-batch's activations but not the whole batch's, the plan lists
    the accumulating layouts as fitting and the whole batch's as short."""
    net = meta_model(mlp)
    loose = plan(net, _cluster(), precision="fp32", batch=16384, input_shape=[1024],
                 input_dtype=torch.float32)
    by = {p.layout.label: p for p in (*loose.fitting, *loose.short)}
    whole, split = by["--backend ddp"], by["--backend ddp --accumulate 8"]
    assert split.total_memory < whole.total_memory
    room = (split.total_memory + whole.total_memory) // 2
    tight = plan(net, _cluster(memory=room), precision="fp32", batch=16384,
                 input_shape=[1024], input_dtype=torch.float32)
    fitting = {p.layout.label for p in tight.fitting}
    assert "--backend ddp --accumulate 8" in fitting and "--backend ddp" not in fitting


def test_a_micro_batch_the_model_refuses_is_refused_with_its_reason() -> None:
    """Batch norm refuses one sample: accumulating a 2-sample replica batch in two is refused
    in the model's words; the whole batch is planned."""
    result = plan(meta_model(normed), _cluster(), precision="fp32", batch=4,
                  input_shape=[3, 2, 2], input_dtype=torch.float32)
    reasons = {r.flags: r.reason for r in result.refused}
    refused = reasons[("--backend ddp", "--accumulate 2")]
    assert "--batch" in refused and "micro-batch of 1 sample" in refused
    assert "--backend ddp" in {p.layout.label for p in result.fitting}


def test_fsdp_gathers_every_micro_batch_and_keeps_unsharded_gradients_until_the_last() -> None:
    """fully_shard without gradient sync keeps each unit's unsharded gradients from its first
    backward to the reduce-scatter in the last: the whole model's beside the shards' place;
    each micro-batch gathers the units again (forward and backward), the gradients are
    reduce-scattered once."""
    net = meta_model(mlp)
    model = model_of(net, [1024], torch.float32, "adam")
    whole, split = (predict(layout(net, "fsdp", {}, 1, 1, world=2, precision="fp32", batch=64,
                                   accumulate=a), model, _cluster(), describe("fp32"))
                    for a in (1, 4))
    gradients = 25_175_040 * 4
    assert split.memory.buffers - whole.memory.buffers == gradients // 2  # less the shards
    sizes = {a: {c.kind: c.size for c in get_backend("fsdp").step_traffic(
        {}, whole.layout.plan, describe("fp32"), 25_175_040, a).collectives} for a in (1, 4)}
    assert sizes[4]["all_gather"] == 4 * sizes[1]["all_gather"]
    assert sizes[4]["reduce_scatter"] == sizes[1]["reduce_scatter"]


def test_zero_2_and_3_reduce_every_micro_batch_and_zero_1_once() -> None:
    """ZeRO-0 and 1 reduce at the accumulation boundary; ZeRO-2 reduces the bucket in every
    micro-batch and gathers the updated parameters once; ZeRO-3 gathers (forward and
    backward) and reduce-scatters in every one. Their copies around the reduction grow
    with it; the norm and the update's stay once a step."""
    net = meta_model(mlp)
    plan_ = layout(net, "deepspeed", {"zero_stage": 1}, 1, 1, world=2, precision="fp32",
                   batch=64).plan
    spec, params = describe("fp32"), 25_175_040

    def traffic(stage: int, a: int) -> tuple[dict[tuple[str, str], tuple[float, int]], float]:
        flow = get_backend("deepspeed").step_traffic({"zero_stage": stage}, plan_, spec,
                                                     params, a)
        return {(c.kind, c.what): (c.size, c.calls) for c in flow.collectives}, flow.copies

    for stage in (0, 1):
        assert traffic(stage, 4) == traffic(stage, 1)
    (once, copied), (each, copied_4) = traffic(2, 1), traffic(2, 4)
    reduced = ("all_reduce", "gradients")
    assert each[reduced] == (4 * once[reduced][0], 4)
    assert each[("all_gather", "parameters")] == once[("all_gather", "parameters")]
    assert copied < copied_4 < 4 * copied  # the reduction's copies only
    (once, copied), (each, copied_4) = traffic(3, 1), traffic(3, 4)
    for key, (size, calls) in once.items():
        assert each[key] == (4 * size, 4 * calls), key
    assert copied < copied_4 < 4 * copied


def test_zero_2_keeps_the_gradients_its_partition_touches_whole() -> None:
    """ZeRO-2 copies each gradient its partition overlaps whole into its partition's buffer
    and keeps it to the step: on the MLP at 2 ranks the last rank's the 4096 x 4096 Linear
    that straddles both partitions and the last Linear (21.0 M of the 25.2 M parameters, not
    12.6 M), the same at 4 ranks; ZeRO-3 keeps its partition's only. At ZeRO-3 no gradient
    is held for autograd to add the next micro-batch's to."""
    net = meta_model(mlp)
    model = model_of(net, [1024], torch.float32, "adam")
    touched = (4096 * 4096 + 4096) + (4096 * 1024 + 1024)
    for world in (2, 4):
        found = {z: predict(layout(net, "deepspeed", {"zero_stage": z}, 1, 1, world=world,
                                   precision="fp32", batch=64 * world, accumulate=4),
                            model, _cluster(), describe("fp32")).memory for z in (2, 3)}
        assert found[2].row.gradients == 4 * touched
        assert found[3].row.gradients == 4 * 25_175_040 // world
        assert (found[2].accumulating, found[3].accumulating) == (LARGEST, 0)
