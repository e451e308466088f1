"""`mpt plan` and ``--grad-compression``: each cast is a layout wherever replicas reduce
gradients, its collectives sent in the cast's dtype and priced by that dtype's calibrated fit,
and each backend's casts there and back in its copies (what torch's comm hooks, fully_shard,
DeepSpeed and Horovod do, term by term); PowerSGD's factors, products and error feedback,
where ddp and apex run it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from plan_models import mlp

from mpt.backends import get_backend
from mpt.comm import GradComm
from mpt.estimate import meta_model
from mpt.parallel import ParallelPlan
from mpt.plan.network import Cluster, collective, fit_of
from mpt.plan.planner import plan
from mpt.plan.profiles import CollectiveFit, device_profile, link_profile
from mpt.precision import describe

PARAMS = 25_175_040  # the MLP's
GRADIENTS = PARAMS * 4  # its fp32 gradients, 100.7 MB
FP16, BF16 = GradComm(compression="fp16"), GradComm(compression="bf16")


def _plan(nodes: int, gpus: int, link=None):
    cluster = Cluster(nodes=nodes, gpus=gpus, device=device_profile("h100-sxm"),
                      link=link or link_profile("1gbit"))
    return plan(meta_model(mlp), cluster, precision="fp32", batch=8 * nodes * gpus,
                input_shape=[1024], input_dtype=torch.float32)


def _by_label(result, label: str):
    return next(p for p in (*result.fitting, *result.short) if p.layout.label == label)


def test_each_cast_is_a_layout_where_replicas_reduce_and_none_where_one_does() -> None:
    two = _plan(2, 1)
    labels = {p.layout.label for p in two.fitting}
    for backend in ("ddp", "apex", "fsdp", "deepspeed --zero-stage 1"):
        for cast in ("fp16", "bf16"):
            assert f"--backend {backend} --grad-compression {cast}" in labels
    assert "--backend horovod --grad-compression fp16" in labels
    reasons = {" ".join(r.flags): r.reason for r in two.refused}
    assert "has no bf16 tensors" in reasons["--backend horovod --grad-compression bf16"]
    chosen = _by_label(two, "--backend ddp --grad-compression bf16").layout
    assert chosen.comm == BF16
    alone = _plan(1, 1)
    assert not any("--grad-compression" in p.layout.label for p in alone.fitting)
    assert not any("--grad-compression" in " ".join(r.flags) for r in alone.refused)


def test_a_cast_halves_what_ddp_sends_and_casts_each_bucket_there_and_back() -> None:
    """torch's ``fp16_compress_hook``: the bucket (copied in and out as without one) cast to
    fp16, allreduced, and copied back into the fp32 bucket: 4 + 2 bytes read and written per
    gradient each way."""
    spec, ddp = describe("fp32"), get_backend("ddp")
    pair = ParallelPlan(dp_replicate=2)
    plain = ddp.step_traffic({}, pair, spec, PARAMS)
    cast = ddp.step_traffic({}, pair, spec, PARAMS, comm=FP16)
    (sent,) = cast.collectives
    assert (sent.kind, sent.size, sent.dtype) == ("all_reduce", GRADIENTS / 2, "float16")
    assert plain.collectives[0].dtype == "float32"
    assert cast.copies == pytest.approx(2 * GRADIENTS + PARAMS * (4 + 2))
    assert cast.copies - plain.copies == pytest.approx(PARAMS * 6)
    horovod = get_backend("horovod").step_traffic({}, pair, spec, PARAMS, comm=FP16)
    assert horovod.collectives[0].library == "horovod"
    assert horovod.collectives[0].dtype == "float16"


def test_fsdp_reduces_in_the_cast_and_casts_the_shard_back() -> None:
    """``foreach_reduce`` with a 16-bit reduce dtype: the gradients cast as they are copied
    into the flat input (4 read, 2 written), the shard divided in it and cast back into a new
    fp32 tensor; the parameters gathered in fp32 as before."""
    spec, fsdp, net = describe("fp32"), get_backend("fsdp"), meta_model(mlp)
    pair = ParallelPlan(dp_shard=2)
    plain = fsdp.step_traffic({}, pair, spec, PARAMS, module=net)
    cast = fsdp.step_traffic({}, pair, spec, PARAMS, module=net, comm=BF16)
    gathers = [c for c in cast.collectives if c.kind == "all_gather"]
    assert gathers == [c for c in plain.collectives if c.kind == "all_gather"]
    (scatter,) = [c for c in cast.collectives if c.kind == "reduce_scatter"]
    assert (scatter.size, scatter.dtype) == (GRADIENTS / 2, "bfloat16")
    weights = 2 * GRADIENTS * 1.5  # two gathers: the shard in, the whole unit out
    whole, shard = PARAMS * (4 + 2) / 2, PARAMS / 2 * (2 + (2 + 4) / 2)
    assert cast.copies == pytest.approx(weights + whole + shard)
    assert plain.copies == pytest.approx(weights + GRADIENTS * 1.5)
    hsdp = fsdp.step_traffic({"replicate": 2}, ParallelPlan(dp_replicate=2, dp_shard=2), spec,
                             PARAMS, comm=BF16)
    (across,) = [c for c in hsdp.collectives if c.kind == "all_reduce"]
    assert (across.size, across.dtype) == (GRADIENTS / 2 / 2, "bfloat16")


def test_deepspeed_sends_its_gradients_in_the_communication_data_type() -> None:
    """``communication_data_type``: ZeRO-1's flat fp32 tensor cast to fp16 for the allreduce
    and the result back (``allreduce_bucket``), a new tensor each step; the parameters'
    all-gather stays fp32."""
    spec, ds, net = describe("fp32"), get_backend("deepspeed"), meta_model(mlp)
    pair = ParallelPlan(dp_shard=2)
    plain = ds.step_traffic({"zero_stage": 1}, pair, spec, PARAMS, module=net)
    cast = ds.step_traffic({"zero_stage": 1}, pair, spec, PARAMS, module=net, comm=FP16)
    reduce, gather = cast.collectives
    assert (reduce.kind, reduce.size, reduce.dtype) == ("all_reduce", GRADIENTS / 2, "float16")
    assert gather == plain.collectives[1]
    assert cast.copies - plain.copies == pytest.approx(GRADIENTS + GRADIENTS / 2)


def test_a_dtype_is_priced_by_its_own_fit_else_by_its_bytes() -> None:
    """gloo sums 16-bit elements on a CPU slower per byte than fp32 ones: a link that
    carries a 16-bit fit prices that dtype's collectives by it, another dtype's by the fp32
    fit; Horovod's by its own fp32 fit before torch's 16-bit one."""
    fp32, half = CollectiveFit(bus_bandwidth=100e6, latency=0.0), CollectiveFit(
        bus_bandwidth=60e6, latency=0.0)
    hvd = CollectiveFit(bus_bandwidth=40e6, latency=0.0)
    fits = {"all_reduce": fp32, "all_reduce/float16": half, "horovod:all_reduce": hvd}
    assert fit_of(fits, "all_reduce", dtype="float16") is half
    assert fit_of(fits, "all_reduce", dtype="bfloat16") is fp32
    assert fit_of(fits, "all_reduce", "horovod", "float16") is hvd
    assert fit_of(fits, "reduce_scatter") is None
    link = replace(link_profile("1gbit"), collectives=fits)
    cluster = Cluster(nodes=2, gpus=1, device=device_profile("h100-sxm"), link=link)
    pair = ParallelPlan(dp_replicate=2)
    sent = collective("all_reduce", GRADIENTS / 2, pair, "dp_replicate", cluster,
                      dtype="float16")
    assert sent.seconds == pytest.approx(GRADIENTS / 2 / 60e6, rel=1e-4)  # ring: 1 x size
    result = _plan(2, 1, link)
    comm = {label: _by_label(result, label).terms["data-parallel communication"]
            for label in ("--backend ddp", "--backend ddp --grad-compression fp16",
                          "--backend ddp --grad-compression bf16")}
    assert comm["--backend ddp"] == pytest.approx(GRADIENTS / 100e6, rel=0.01)
    assert comm["--backend ddp --grad-compression fp16"] == pytest.approx(
        GRADIENTS / 2 / 60e6, rel=0.01)
    assert comm["--backend ddp --grad-compression bf16"] == pytest.approx(
        GRADIENTS / 2 / 100e6, rel=0.01)


POWERSGD = GradComm(compression="powersgd")
VECTORS = 4096 + 4096 + 1024  # the MLP's biases, which PowerSGD sends as they are
SIDES = 1024 + 4096 + 4096  # each matrix's rows, and each one's columns, summed


def test_powersgd_sends_each_matrix_as_two_factors_and_the_rest_as_it_is() -> None:
    """torch's ``powerSGD_hook`` at rank r: each weight n x m as P (n x r) and Q (m x r), the
    biases allreduced as they are; its three products per matrix (M Q, M^T P, P Q^T); the
    error feedback added, the sum cloned and the new error made (4 bytes a gradient each way,
    1.5 + 1 + 1.5), the biases gathered, divided and copied back; the error kept beside
    DDP's buckets."""
    spec, ddp, net = describe("fp32"), get_backend("ddp"), meta_model(mlp)
    pair = ParallelPlan(dp_replicate=2)
    plain = ddp.step_traffic({}, pair, spec, PARAMS, module=net)
    flow = ddp.step_traffic({}, pair, spec, PARAMS, module=net, comm=POWERSGD)
    assert {c.what: c.size for c in flow.collectives} == {
        "gradients PowerSGD leaves": 4 * VECTORS, "PowerSGD's P factors": 4 * SIDES,
        "PowerSGD's Q factors": 4 * SIDES}
    assert flow.matmuls == ((4096, 1024, 1), (1024, 4096, 1), (4096, 1, 1024),
                            (4096, 4096, 1), (4096, 4096, 1), (4096, 1, 4096),
                            (1024, 4096, 1), (4096, 1024, 1), (1024, 1, 4096))
    assert flow.copies == pytest.approx(plain.copies + 4 * GRADIENTS + 3 * 4 * VECTORS)
    ranked = ddp.step_traffic({"powersgd_rank": 2}, pair, spec, PARAMS, module=net,
                              comm=POWERSGD)
    assert {c.what: c.size for c in ranked.collectives}["PowerSGD's Q factors"] == 8 * SIDES
    assert ddp.step_traffic({}, ParallelPlan(dp_replicate=1), spec, PARAMS, module=net,
                            comm=POWERSGD) == ddp.step_traffic({}, ParallelPlan(dp_replicate=1),
                                                               spec, PARAMS, module=net)

    result = _plan(2, 1)
    ddp_plain, compressed = (_by_label(result, f"--backend ddp{flag}")
                             for flag in ("", " --grad-compression powersgd"))
    assert compressed.memory.buffers - ddp_plain.memory.buffers == 4 * PARAMS + 8 * SIDES
    assert compressed.terms["backend matmuls"] > 0 == ddp_plain.terms["backend matmuls"]
    assert compressed.link_bytes == pytest.approx(4 * (VECTORS + 2 * SIDES))


def test_powersgd_is_planned_where_mpt_runs_it_and_refused_elsewhere() -> None:
    result = _plan(2, 2)
    labels = {p.layout.label for p in result.fitting}
    assert {"--backend ddp --grad-compression powersgd",
            "--backend apex --grad-compression powersgd"} <= labels
    reasons = {" ".join(r.flags): r.reason for r in result.refused}
    for refused in ("--backend fsdp", "--backend horovod", "--backend deepspeed --zero-stage 1",
                    "--backend ddp --pipeline-stages 2"):
        assert "PowerSGD" in reasons[f"{refused} --grad-compression powersgd"]
