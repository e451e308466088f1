"""The per-rank peak `mpt plan` predicts, term by term, for the MLP benchmarks/plan_memory.py
measures (docs/benchmarks.md: within 10 % of the peak RSS of 2 CPU processes)."""

from __future__ import annotations

import pytest
import torch
from plan_models import mlp

from mpt.backends.horovod import FUSION_DEFAULT
from mpt.estimate import activation_bytes, example_input, meta_model
from mpt.plan.cost import Prediction, predict
from mpt.plan.layouts import layout
from mpt.plan.network import Cluster
from mpt.plan.planner import model_of
from mpt.plan.profiles import Device, device_profile, link_profile
from mpt.precision import describe

LARGEST = 4096 * 4096 * 4  # the MLP's largest weight, fp32
UNIT = LARGEST + 4096 * 4  # its Linear: fsdp's largest unit


def _cluster(device_type: str = "cpu") -> Cluster:
    host = Device(name="host", flops={"float32": 1e11}, memory_bandwidth=1e10, memory=64e9,
                  intra_node=link_profile("10gbit"), device_type=device_type)
    return Cluster(nodes=1, gpus=2, device=host, link=link_profile("1gbit"))


def _predict(backend: str, batch: int, device_type: str = "cpu", precision: str = "fp32",
             **options: object) -> Prediction:
    net = meta_model(mlp)
    chosen = layout(net, backend, options, 1, 1, world=2, precision=precision,
                    batch=2 * batch)
    return predict(chosen, model_of(net, [1024], torch.float32, "adam"), _cluster(device_type),
                   describe(precision))


def test_ddp_adds_its_buckets_and_adams_temporaries() -> None:
    p = _predict("ddp", 64).memory
    assert p.buffers == p.row.gradients  # the buckets: a copy of the gradients
    assert p.transient == 2 * LARGEST  # sqrt(v) and its quotient of the largest weight
    assert p.batch == 64 * 1024 * 4  # the replica's batch, which the script holds
    assert p.peak == p.row.device + p.buffers + p.batch + p.transient
    assert _predict("ddp", 64, "cuda").memory.transient == 4 * 25_175_040  # foreach: at once


def test_deepspeed_steps_its_flat_partition_after_letting_go_of_its_buffers() -> None:
    """ZeRO 1-3 step the rank's half of the MLP as one flat fp32 tensor: Adam's two
    temporaries are of all of it (measured: 2 x 48 MiB above the set at the optimizer's
    pre-hook), where ZeRO-0 steps the model's own weights. ZeRO-1 and 2 let go of their
    bucket and the model's gradients before it; ZeRO-3 of all but its bucket, and it
    flattens its half of the gradients in fp32 for the step, as ZeRO-1 and 2 do after the
    backward."""
    trained = 25_175_040
    half = 4 * trained // 2
    assert _predict("deepspeed", 64, zero_stage=0).memory.transient == 2 * LARGEST
    for stage in (1, 2, 3):
        assert _predict("deepspeed", 64, zero_stage=stage).memory.transient == 2 * half
    # on CUDA torch's foreach Adam takes sqrt(v) of the flat tensor at once
    assert _predict("deepspeed", 64, "cuda", zero_stage=3).memory.transient == half
    one = _predict("deepspeed", 64, zero_stage=1).memory
    assert one.released == one.row.gradients and one.stepping == half
    # in the step: the weights, the optimizer's state, the flat partition and Adam's two
    step = one.row.device + one.transient + one.stepping - one.released
    assert step == one.row.parameters + one.row.optimizer + 3 * half
    # after the backward the bucket (every gradient) and the flat partition, not beside the
    # activations
    assert one.between == 4 * trained + half and one.buffers == 0
    assert one.peak == one.row.device + one.batch + max(one.activations, one.between, step
                                                        - one.row.device)
    three = _predict("deepspeed", 64, zero_stage=3).memory
    assert three.stepping == half and three.released == three.buffers - 4 * trained
    assert three.peak == three.row.device + three.buffers + three.batch + max(
        three.activations, three.transient + three.stepping - three.released)


def test_horovods_fusion_buffer_is_whole_where_the_device_allocates_it_whole() -> None:
    """Horovod allocates its fusion buffer at the whole threshold; a CPU rank's pages are
    resident only where fused gradients wrote them (at most all of them: the MLP's 100.7 MB),
    a GPU's allocator hands out all 128 MiB."""
    gradients = 4 * 25_175_040
    cpu = _predict("horovod", 64).memory
    assert cpu.buffers == 2 * gradients  # the copies handed over, and the fused bound
    net = meta_model(mlp)
    chosen = layout(net, "horovod", {}, 1, 1, world=2, precision="fp32", batch=128)
    gpu = predict(chosen, model_of(net, [1024], torch.float32, "adam"),
                  Cluster(nodes=1, gpus=2, device=device_profile("h100-sxm"),
                          link=link_profile("100gbit")), describe("fp32")).memory
    assert gpu.buffers == gradients + FUSION_DEFAULT


def test_fsdp_peaks_in_the_backward_with_a_prefetched_unit() -> None:
    """In the largest unit's backward (its weights and gradients in the row), the unit before
    it gathered ahead (its flat output and the rank's half copied in) and the reduce-scatter
    input of the unit after it; all three freed by the step."""
    first, last = (1024 * 4096 + 4096) * 4, (4096 * 1024 + 1024) * 4
    p = _predict("fsdp", 64).memory
    assert p.buffers == 1.5 * first + last and p.released == p.buffers + 2 * UNIT
    assert p.transient == LARGEST  # its shard of the largest weight, twice
    assert p.peak == p.row.device + p.buffers + p.batch + p.activations


def test_fsdps_buffers_follow_the_units_beside_the_one_that_runs() -> None:
    """Alike units: one gathered ahead (none at one shard) and one reduce-scatter input
    whatever the largest; the root's own parameters are gathered first."""
    from plan_models import deep

    from mpt.backends.fsdp import held_beside

    unit = 2048 * 2048 + 2048
    assert held_beside(deep(), None, 2) == 1.5 * unit + unit
    assert held_beside(deep(), None, 4) == 1.25 * unit + unit
    # one shard: fully_shard gathers nothing ahead (each parameter is copied from its shard
    # when its unit runs), so only the next unit's reduce-scatter input lies beside it
    assert held_beside(deep(), None, 1) == unit
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 8))  # too small a unit: the root holds it
    assert held_beside(tiny, None, 2) == 0  # nothing beside the one that runs
    # not resharded after the forward: in the last 2048-wide unit's backward, the first unit
    # (half as large) and the five alike ones before it still gathered beside it, and the last
    # unit's reduce-scatter input
    last = 2048 * 1024 + 1024
    kept = (2048 * 1024 + 2048) + 5 * unit
    assert held_beside(deep(), None, 2, reshard=False) == kept + last


def test_a_tensor_two_blocks_save_counts_once() -> None:
    """A ReLU saves its result, which the next Linear saves as its input; the first Linear
    saves the batch itself, counted as the batch."""
    whole = activation_bytes(meta_model(mlp), example_input([2048, 1024], torch.float32))
    held = _predict("ddp", 2048).memory
    assert held.batch == 2048 * 1024 * 4
    assert held.activations + held.batch == pytest.approx(whole)
    # a 16-bit forward saves the batch's cast copy: the batch and that copy
    cast = _predict("apex", 2048, precision="O3").memory
    assert cast.activations == pytest.approx(whole / 2)
    assert cast.batch == held.batch


def test_a_backward_after_the_first_micro_batch_adds_each_weights_gradient() -> None:
    """Over several micro-batches autograd computes each weight's gradient of a later one into
    a new tensor beside the one it adds to: the stage's largest weight beside the
    activations. A replica's single pass leaves its gradients where they are made."""
    net = meta_model(mlp)
    single = layout(net, "ddp", {}, 1, 1, world=2, precision="fp32", batch=64)
    several = layout(net, "ddp", {}, 2, 1, world=2, precision="fp32", batch=64, microbatches=4)
    model = model_of(net, [1024], torch.float32, "adam")
    assert predict(single, model, _cluster(), describe("fp32")).memory.accumulating == 0
    # the fullest stage, the last two Linears: 4096 x 4096 the largest
    assert predict(several, model, _cluster(), describe("fp32")).memory.accumulating == LARGEST
