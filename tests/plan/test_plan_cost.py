"""The cost model's terms against the ring bound, the bubble formula and the bytes on the wire
docs/benchmarks.md measured."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from plan_models import deep, mlp

from mpt.backends import get_backend
from mpt.comm import GradComm
from mpt.errors import UsageError
from mpt.estimate import meta_model
from mpt.parallel import ParallelPlan
from mpt.pipeline.split import stage_blocks
from mpt.plan.calibrate import collective_fit, ring_fit
from mpt.plan.network import Cluster, collective
from mpt.plan.planner import plan
from mpt.plan.profiles import CollectiveFit, device_profile, link_profile
from mpt.precision import describe

GRADIENTS = 25_175_040 * 4  # the MLP's fp32 gradients, 100.7 MB


def _cluster(nodes: int, gpus: int, link: str = "1gbit") -> Cluster:
    return Cluster(nodes=nodes, gpus=gpus, device=device_profile("h100-sxm"),
                   link=link_profile(link))


def _plan(nodes: int, gpus: int, link: str = "1gbit", **kw):
    return plan(meta_model(mlp), _cluster(nodes, gpus, link), precision="fp32",
                batch=8 * nodes * gpus, input_shape=[1024], input_dtype=torch.float32, **kw)


def _by_label(result, label: str):
    return next(p for p in (*result.fitting, *result.short) if p.layout.label == label)


def test_allreduce_across_two_nodes_is_the_ring_bound() -> None:
    """docs/benchmarks.md: ring bound of 100.7 MB at 1 Gbit/s over 2 nodes, 0.806 s."""
    cluster = _cluster(2, 1)
    moved = collective("all_reduce", GRADIENTS, ParallelPlan(dp_replicate=2), "dp_replicate",
                       cluster)
    assert moved.link_bytes == pytest.approx(GRADIENTS)
    assert moved.seconds == pytest.approx(0.806, abs=0.001)


def test_a_collective_measured_across_the_nodes_is_priced_by_its_own_fit() -> None:
    """A link that carries a measured fit prices that collective by it (gloo's reduce-scatter
    at a fraction of the link's rate) and the others at the link's rate."""
    slow = CollectiveFit(bus_bandwidth=31.25e6, latency=1e-3)  # a quarter of 1 Gbit/s
    link = replace(link_profile("1gbit"), collectives={"reduce_scatter": slow})
    cluster = replace(_cluster(2, 1), link=link)
    layout = ParallelPlan(dp_shard=2)
    scattered = collective("reduce_scatter", GRADIENTS, layout, "dp_shard", cluster)
    assert scattered.link_bytes == pytest.approx(GRADIENTS / 2)  # the ring's bytes still
    assert scattered.seconds == pytest.approx(1e-3 + GRADIENTS / 2 / 31.25e6)
    gathered = collective("all_gather", GRADIENTS, layout, "dp_shard", cluster)
    assert gathered.seconds == pytest.approx(
        collective("all_gather", GRADIENTS, layout, "dp_shard", _cluster(2, 1)).seconds)


def test_a_collective_whose_rate_falls_with_its_size_is_priced_at_each_calls_size() -> None:
    """gloo's all-gather between two nodes at 1 Gbit/s, as swept here (docs/benchmarks.md):
    100 MB/s of ring bytes at 4 MiB, 72 at 32 MiB. The fitted line follows the largest and
    prices 4 MiB 1.2 x; the rates measured at each size price every call at its own."""
    measured = {16 << 10: 0.39e-3, 256 << 10: 0.44e-3, 2 << 20: 8.69e-3, 4 << 20: 20.99e-3,
                8 << 20: 48.86e-3, 32 << 20: 233.19e-3}
    swept = collective_fit(ring_fit("all_gather",
                                    [(size / 2, t) for size, t in measured.items()], 2))
    layout = ParallelPlan(dp_shard=2)

    def priced(fit: CollectiveFit, size: int, calls: int = 1) -> float:
        link = replace(link_profile("1gbit"), collectives={"all_gather": fit})
        return collective("all_gather", size, layout, "dp_shard",
                          replace(_cluster(2, 1), link=link), calls=calls).seconds

    line = replace(swept, rates=())
    assert priced(line, 4 << 20) > 1.15 * measured[4 << 20]
    for size, seconds in measured.items():
        assert priced(swept, size) == pytest.approx(seconds, rel=0.02)
    # 16 units of 4 MiB, each call at its own size: 16 of the 4 MiB gather
    assert priced(swept, 64 << 20, calls=16) == pytest.approx(16 * measured[4 << 20], rel=0.02)


def test_horovods_allreduce_is_priced_by_its_own_fit_where_one_was_calibrated() -> None:
    """Horovod declares its gradients' allreduce as its own; a link that carries a
    ``horovod:all_reduce`` fit prices it by that, ddp's by torch's, and without one both
    alike."""
    fast = CollectiveFit(bus_bandwidth=100e6, latency=1e-4)
    slow = CollectiveFit(bus_bandwidth=40e6, latency=1e-4)
    link = replace(link_profile("1gbit"),
                   collectives={"all_reduce": fast, "horovod:all_reduce": slow})
    measured = plan(meta_model(mlp), replace(_cluster(2, 1), link=link), precision="fp32",
                    batch=16, input_shape=[1024], input_dtype=torch.float32)

    def comm(result, backend: str) -> float:
        """Its allreduce's seconds, those hidden behind the backward (NCCL's overlap) too."""
        terms = _by_label(result, f"--backend {backend}").terms
        return terms["data-parallel communication"] + terms["backward"]

    ring = GRADIENTS  # 2(N-1)/N x the gradients at N = 2
    buckets = 5  # DDP's: 1 MiB, then 25 MiB at a time of 100.7 MB; Horovod fuses 128 MiB
    assert comm(measured, "ddp") == pytest.approx(buckets * 2 * 1e-4 + ring / 100e6)
    assert comm(measured, "horovod") == pytest.approx(2 * 1e-4 + ring / 40e6)
    datasheet = _plan(2, 1)
    assert comm(datasheet, "ddp") - comm(datasheet, "horovod") == pytest.approx(
        (buckets - 1) * 2 * link_profile("1gbit").latency)


def test_bytes_on_the_link_match_the_measured_ones() -> None:
    """Measured per node per step at 2 nodes (docs/benchmarks.md, `make scaling`): ddp, apex,
    horovod 100.9 MB; DeepSpeed ZeRO-1 151 MB."""
    result = _plan(2, 1)
    for label in ("--backend ddp", "--backend apex", "--backend horovod"):
        assert _by_label(result, label).link_bytes / 1e6 == pytest.approx(100.7, abs=0.1)
    zero1 = _by_label(result, "--backend deepspeed --zero-stage 1")
    assert zero1.link_bytes / 1e6 == pytest.approx(151.0, abs=0.2)


def test_a_pipelines_bubble_is_its_schedules_simulated_wait() -> None:
    """The plan's bubble and sends are the simulation's of the layout's schedule over its
    chunks; the MLP's two stages differ (its middle Linear holds two thirds of the
    parameters), so the faster one's idle time is not the slower one's bubble."""
    result = _plan(1, 2)
    for schedule in ("1f1b", "gpipe", "interleaved-1f1b"):
        flag = "" if schedule == "1f1b" else f" --pipeline-schedule {schedule}"
        piped = _by_label(result, f"--backend ddp --pipeline-stages 2{flag} --microbatches 4")
        assert piped.layout.schedule == schedule
        assert piped.bubble > 0
        work = piped.terms["forward"] + piped.terms["backward"]
        # below 1F1B's formula for equal stages: the slower stage waits for the faster one
        assert piped.bubble / (work + piped.bubble) < (2 - 1) / (4 + 2 - 1)


def test_the_schedules_of_alike_stages_wait_as_their_papers_say() -> None:
    """Eight alike layers at P = 2, M = 4: 1F1B and GPipe wait about P - 1 micro-batches of
    work (not exactly: the first and last Linear are half the others), interleaved 1F1B about
    half of that, zero bubble less again (what each keeps: test_plan_schedule.py)."""
    result = plan(meta_model(deep), _cluster(1, 2), precision="fp32", batch=16,
                  input_shape=[1024], input_dtype=torch.float32)
    by = {p.layout.schedule: p for p in result.fitting if p.layout.backend == "ddp"
          and p.layout.plan.pp == 2 and p.layout.microbatches == 4}

    def waited(p) -> float:  # in micro-batches of the busiest rank's work
        return p.bubble / (p.terms["forward"] + p.terms["backward"]) * 4

    assert waited(by["1f1b"]) == pytest.approx(1, rel=0.1)
    assert waited(by["gpipe"]) == pytest.approx(1, rel=0.1)
    assert waited(by["interleaved-1f1b"]) < 0.6 * waited(by["1f1b"])
    assert waited(by["interleaved-zb"]) < waited(by["interleaved-1f1b"])


def test_zero_bubbles_first_chunk_runs_its_whole_backward_as_its_w(monkeypatch) -> None:
    """torch's first stage has no input gradient to make: its I does nothing, its W the
    whole backward. Every later chunk splits its backward in two and keeps, from I to W, the
    gradient of each Linear's output (the deep model: 2048 features a row, 1024 the last)."""
    import mpt.plan.cost as cost
    from mpt.plan.layouts import layout
    from mpt.plan.planner import model_of

    seen, simulated = {}, cost.simulate

    def simulate(schedule, stages, microbatches, chunks):
        seen["chunks"] = chunks
        return simulated(schedule, stages, microbatches, chunks)

    net = meta_model(deep)
    chosen = layout(net, "ddp", {}, 2, 1, world=2, precision="fp32", batch=16,
                    microbatches=4, schedule="interleaved-zb")
    monkeypatch.setattr(cost, "simulate", simulate)
    cost.predict(chosen, model_of(net, [1024], torch.float32, "adam"), _cluster(1, 2),
                 describe("fp32"))
    first, *later = seen["chunks"]
    assert first.weight == pytest.approx(first.backward) and first.pending == 0
    for chunk in later:
        assert chunk.weight == pytest.approx(chunk.backward / 2)
    linears = [[n for n, m in b if isinstance(m, torch.nn.Linear)]
               for b in stage_blocks(net, 4)][1:]
    assert [c.pending for c in later] == [
        4 * 4 * sum(1024 if n == "14" else 2048 for n in names) for names in linears]


def test_every_schedule_and_micro_batch_count_is_a_layout() -> None:
    """At P = 2 and 16 samples a replica: each schedule at M = 2, 4, 8 and 16; the MLP's 5
    blocks cut into 4 chunks, so the looped schedules run too."""
    result = _plan(1, 2)
    found = {(p.layout.schedule, p.layout.microbatches) for p in result.fitting
             if p.layout.backend == "ddp" and p.layout.plan.pp == 2}
    assert found == {(s, m) for s in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb")
                     for m in (2, 4, 8, 16)}


def test_a_looped_schedule_of_a_model_with_too_few_blocks_is_refused_in_mpts_words() -> None:
    """mpt cuts 2P chunks under a looped schedule: the MLP's 5 blocks do not make 8."""
    result = _plan(1, 4)
    reasons = {" ".join(r.flags): r.reason for r in result.refused}
    assert "the model has 5 blocks to split" in reasons[
        "--backend ddp --pipeline-stages 4 --pipeline-schedule interleaved-1f1b"]
    assert any(p.layout.label.startswith("--backend ddp --pipeline-stages 4 --microbatches")
               for p in result.fitting)


def test_refusals_are_mpts_own() -> None:
    result = _plan(1, 2)
    reasons = {" ".join(r.flags): r.reason for r in result.refused}
    assert "cannot cut a model into pipeline stages" in reasons[
        "--backend horovod --pipeline-stages 2"]
    assert "Sequential declares no tensor-parallel plan" in reasons[
        "--backend ddp --tensor-parallel 2"]


def test_unknown_profiles_list_the_known() -> None:
    with pytest.raises(UsageError, match="h100-sxm"):
        device_profile("b300")
    with pytest.raises(UsageError, match="400gbit"):
        link_profile("carrier-pigeon")
    assert link_profile("25gbit").bandwidth == pytest.approx(25e9 / 8)


def test_a_pipeline_that_reshards_sends_fsdps_collectives_per_micro_batch() -> None:
    """Under a pipeline fsdp gathers and reduce-scatters once per schedule, or, resharding
    (--fsdp-reshard-after-forward yes), in every micro-batch: M x the reduce-scatter and two
    all-gathers instead of one."""
    spec = describe("fp32")
    layout = ParallelPlan(pp=2, dp_shard=2)
    fsdp = get_backend("fsdp")
    kept = fsdp.step_traffic({}, layout, spec, 1e6, microbatches=4)
    resharded = fsdp.step_traffic({"reshard_after_forward": True}, layout, spec, 1e6,
                                  microbatches=4)
    assert [c.kind for c in kept.collectives] == ["all_gather", "reduce_scatter"]
    assert [c.kind for c in resharded.collectives] == ["all_gather", "all_gather",
                                                        "reduce_scatter"]
    assert [c.size for c in resharded.collectives] == [16e6, 16e6, 16e6]
    assert [c.size for c in kept.collectives] == [4e6, 4e6]
    # the option as a launch gives it (RunConfig.backend_options: text) is parsed, not read
    for text, priced in (("no", kept), ("yes", resharded)):
        assert fsdp.step_traffic({"reshard_after_forward": text}, layout, spec, 1e6,
                                 microbatches=4) == priced


@pytest.mark.parametrize("microbatches", [2, 4])
def test_a_pipeline_stage_keeps_a_receive_buffer_per_micro_batch(microbatches: int) -> None:
    """torch's PipelineStage allocates, for every micro-batch, the input another stage sends
    it, and the last stage keeps every micro-batch's output until its next step: the MLP's
    fullest stage (its last two Linears) receives 4096 features a row and puts out 1024,
    whatever the global batch's split. ddp's replicas then average in flat buckets after the
    backward, one at a time: the largest, the 4096 x 4096 weight alone, lies between the
    backward and the step."""
    from mpt.plan.cost import predict
    from mpt.plan.layouts import layout
    from mpt.plan.planner import model_of

    net = meta_model(mlp)
    chosen = layout(net, "ddp", {}, 2, 1, world=2, precision="fp32", batch=64,
                    microbatches=microbatches)
    found = predict(chosen, model_of(net, [1024], torch.float32, "adam"), _cluster(1, 2),
                    describe("fp32")).memory
    assert found.buffers == 64 * (4096 + 1024) * 4
    assert found.between == 4096 * 4096 * 4
    # zero bubble leaves each chunk's input gradient on its receive buffer until the next
    # step: the second rank's chunks, Linear(4096, 4096) and Linear(4096, 1024), each receive
    # 4096 features and keep their gradient; the first sends back 4096, the last puts out 1024
    assert [[n for n, _ in b] for b in stage_blocks(net, 4)][1::2] == [["2"], ["4"]]
    zero = replace(chosen, schedule="interleaved-zb")
    assert predict(zero, model_of(net, [1024], torch.float32, "adam"), _cluster(1, 2),
                   describe("fp32")).memory.buffers == 64 * (2 * 2 * 4096 + 4096 + 1024) * 4


def test_a_pipeline_over_fsdp_that_fits_only_resharding_is_planned_so() -> None:
    """fsdp under a pipeline keeps each stage gathered by default; `mpt plan` prices the
    resharding variant beside it, which fits where the default is short."""
    h100 = device_profile("h100-sxm")
    kept, resharded = ("--backend fsdp --pipeline-stages 2 --microbatches 4",
                       "--backend fsdp --fsdp-reshard-after-forward yes --pipeline-stages 2 "
                       "--microbatches 4")
    roomy = plan(meta_model(mlp), Cluster(nodes=1, gpus=4, device=h100,
                                          link=link_profile("1gbit")),
                 precision="fp32", batch=32, input_shape=[1024], input_dtype=torch.float32)
    assert _by_label(roomy, resharded).total_memory < _by_label(roomy, kept).total_memory
    assert _by_label(roomy, resharded).step > _by_label(roomy, kept).step  # M x the gathers
    room = (_by_label(roomy, resharded).total_memory + _by_label(roomy, kept).total_memory) / 2
    tight = plan(meta_model(mlp), Cluster(nodes=1, gpus=4, device=replace(h100, memory=room),
                                          link=link_profile("1gbit")),
                 precision="fp32", batch=32, input_shape=[1024], input_dtype=torch.float32)
    assert resharded in {p.layout.label for p in tight.fitting}
    assert _by_label(tight, kept).short > 0


def _calibrated(**figures) -> Cluster:
    from mpt.plan.profiles import Device

    device = Device(name="calibrated", flops={"float32": 100e9}, memory_bandwidth=20e9,
                    memory=64e9, intra_node=link_profile("10gbit"), device_type="cpu",
                    **figures)
    return Cluster(nodes=1, gpus=2, device=device, link=link_profile("1gbit"))


def test_a_skinny_matmul_runs_at_the_throughput_of_its_shape() -> None:
    """Interpolated by the smallest dimension (log-linear), rows and inner apart; the peak
    beyond the sweep, without a shape, and on a datasheet profile."""
    sweep = {"float32": {"rows": [[1, 10e9], [16, 40e9], [1024, 100e9]],
                         "inner": [[1, 5e9], [16, 60e9], [1024, 100e9]]}}
    device = _calibrated(matmul_sweep=sweep).device
    assert device.matmul_flops("float32", (16, 2048, 2048)) == pytest.approx(40e9)
    assert device.matmul_flops("float32", (2048, 16, 512)) == pytest.approx(60e9)
    assert device.matmul_flops("float32", (4, 512, 512)) == pytest.approx(25e9)  # halfway
    assert device.matmul_flops("float32", (1, 8, 8)) == pytest.approx(10e9)
    assert device.matmul_flops("float32", (4096, 4096, 4096)) == pytest.approx(100e9)
    assert device.matmul_flops("float32") == device.matmul_flops("bfloat16") == 100e9
    h100 = device_profile("h100-sxm")
    assert h100.matmul_flops("bfloat16", (16, 4096, 4096)) == 989e12


def test_the_workload_records_each_matmuls_shape() -> None:
    from mpt.plan.workload import profile

    work = profile(meta_model(mlp), [1024], torch.float32, 16)
    shapes = {op.shape for block in work.blocks for op in (*block.forward, *block.backward)
              if op.flops}
    assert (16, 1024, 4096) in shapes  # forward
    assert (16, 4096, 4096) in shapes  # an input gradient
    assert (4096, 16, 4096) in shapes  # a weight gradient: the batch is the inner dimension


def test_profiling_a_model_again_records_the_same_backward() -> None:
    """`mpt plan` profiles one meta model at every micro-batch size its layouts use: the
    gradients of one profile must not turn the next one's backward into an accumulation."""
    from mpt.plan.workload import profile

    net = meta_model(mlp)
    first, again = (profile(net, [1024], torch.float32, 16) for _ in range(2))
    assert [b.backward for b in again.blocks] == [b.backward for b in first.blocks]
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("transposed", [False, True])
def test_a_convolution_is_priced_as_the_gemms_of_its_im2col_form(transposed: bool) -> None:
    """Forward, input gradient and weight gradient each as the GEMM that im2col makes of them
    (a transposed convolution's forward and input gradient swapped), their FLOPs torch's."""
    from torch import nn

    from mpt.plan.workload import profile

    conv = (nn.ConvTranspose2d if transposed else nn.Conv2d)(8, 16, 3, stride=2, padding=1)
    net = nn.Sequential(nn.Linear(4, 8 * 10 * 10), nn.Unflatten(1, (8, 10, 10)), conv)
    work = profile(net.to("meta"), [4], torch.float32, 2)
    convs = [(op.shape, op.flops) for block in work.blocks
             for op in (*block.forward, *block.backward) if op.flops and 800 not in op.shape]
    # the ordinary convolution slides its 8 x 3 x 3 patch over a 5 x 5 output (2 samples: 50
    # rows) to 16 channels; the transposed one undoes a 16 x 3 x 3 patch over its 10 x 10 input
    rows, patch, out = (200, 16 * 9, 8) if transposed else (50, 8 * 9, 16)
    gemm = (rows, out, patch) if transposed else (rows, patch, out)
    gradient = (rows, patch, out) if transposed else (rows, out, patch)
    assert sorted(shape for shape, _ in convs) == sorted([gemm, gradient, (out, rows, patch)])
    flops = 2 * rows * patch * out
    assert all(f == flops for _, f in convs)


def test_deepspeed_zero_1_and_2_copy_into_buffers_allocated_at_every_step() -> None:
    """DeepSpeed 0.19's stage_1_and_2.py: every gradient into the reduction bucket, divided
    there in place, the bucket's slices flattened to be allreduced and the rank's own copied
    back, the rank's partition out of it, each of the partition's gradients in fp64 for the
    norm and read by it, the partition flattened, and the updated partition into the weights:
    the MLP's 100.7 MB at 2 ranks. At one rank no slices are flattened. ZeRO-0 (the engine's
    allreduce): flattened, divided over several ranks, copied back; cast there and back
    where it sends another dtype."""
    spec, params, net = describe("fp32"), 25_175_040, meta_model(mlp)
    ds = get_backend("deepspeed")
    flow = ds.step_traffic({"zero_stage": 1}, ParallelPlan(dp_shard=2), spec, params, module=net)
    half = GRADIENTS / 2
    assert flow.copies == pytest.approx(
        2 * GRADIENTS + GRADIENTS * 1.5  # in and divided; flattened, a half back
        + 2 * half  # out, flattened
        + half * (4 + 16) / 8 + half)  # to fp64 and read (20 bytes a parameter); to the weights
    alone = ds.step_traffic({"zero_stage": 1}, ParallelPlan(dp_shard=1), spec, params,
                            module=net)
    assert alone.copies == pytest.approx(2 * GRADIENTS + 2 * GRADIENTS + 2.5 * GRADIENTS
                                         + GRADIENTS)
    def zero(ranks: int, comm: GradComm | None = None) -> float:
        return ds.step_traffic({"zero_stage": 0}, ParallelPlan(dp_replicate=ranks), spec,
                               params, module=net, comm=comm).copies

    assert zero(1) == pytest.approx(2 * GRADIENTS)
    assert zero(2) == pytest.approx(3 * GRADIENTS)
    assert zero(2, GradComm(compression="bf16")) == pytest.approx(4.5 * GRADIENTS)


def test_deepspeed_zero_3_concatenates_its_gradients_and_steps_an_fp32_partition() -> None:
    """DeepSpeed 0.19's stage3.py: every gradient concatenated and divided in place, the
    rank's shard copied into its fp32 partition, cast to fp64 and read for the norm and
    unscaled in place; in a 16-bit mode the update back into the weights. At one rank the
    two all-gathers and the reduce-scatter are a copy each (traced for the MLP at one rank,
    ``copy_`` alone writes 151 M elements a step: 6 x its parameters); over two, the gather
    copies the rank's half into its flat input and every parameter out of it (profiled:
    ``torch.cat``)."""
    params = 25_175_040
    ds = get_backend("deepspeed")

    def copies(precision: str, ranks: int) -> float:
        return ds.step_traffic({"zero_stage": 3}, ParallelPlan(dp_shard=ranks),
                               describe(precision), params).copies

    half = params / 2
    assert copies("fp32", 2) == pytest.approx(
        2 * GRADIENTS + half * 4 + half * (4 + 16) / 2 + half * 4 + 1.5 * GRADIENTS)
    assert copies("fp32", 1) == pytest.approx(
        5 * GRADIENTS + params * 4 + params * 10 + params * 4)
    assert copies("bf16-mixed", 2) == pytest.approx(  # DeepSpeed's bf16 mode: 2-byte grads
        2 * GRADIENTS / 2 + half * 3 + half * (2 + 16) / 2 + half * 4 + half * 3
        + 1.5 * GRADIENTS / 2)


def test_deepspeed_zero_2_allreduces_its_bucket_as_zero_1_does() -> None:
    """DeepSpeed's default ``use_multi_rank_bucket_allreduce`` sends ZeRO-2's gradients through
    the allreduce of the whole bucket that ZeRO-1 sends (counted: 100.7 MB a step at 2 ranks
    under either); ZeRO-3 reduce-scatters them after its all-gather, which the backward
    repeats only for the parameters the forward fetched more than half of
    ``stage3_max_reuse_distance`` before its end (traced: one gather a step at 2 ranks)."""
    spec, params = describe("fp32"), 25_175_040
    ds = get_backend("deepspeed")
    one, two, three = (ds.step_traffic({"zero_stage": s}, ParallelPlan(dp_shard=2), spec, params)
                       for s in (1, 2, 3))
    assert [c.kind for c in two.collectives] == ["all_reduce", "all_gather"]
    assert two.collectives == one.collectives
    assert [c.kind for c in three.collectives] == ["all_gather", "reduce_scatter"]
    large = ds.step_traffic({"zero_stage": 3}, ParallelPlan(dp_shard=2), spec, 7e8)
    gathered = [c.size for c in large.collectives if c.kind == "all_gather"]
    assert gathered == [7e8 * 4, 2e8 * 4]  # 700 M fetched, the first 200 M again


def test_the_optimizer_step_takes_its_calibrated_time_per_parameter() -> None:
    """Calibrated: torch's step per parameter; datasheet: its bytes at the memory
    bandwidth."""
    from mpt.plan.cost import optimizer_seconds
    from mpt.plan.planner import model_of

    model = model_of(meta_model(mlp), [1024], torch.float32, "sgd-momentum")
    calibrated = _calibrated(update_seconds={"sgd-momentum": 1e-9})
    assert optimizer_seconds(1e6, model, calibrated) == pytest.approx(1e-3)
    assert optimizer_seconds(1e6, model, _calibrated()) == pytest.approx(1e6 * 20 / 20e9)


def test_the_backends_copies_around_their_collectives_are_their_own_term() -> None:
    """The MLP (25,175,040 fp32 parameters) on 2 ranks. DDP copies its gradients into the
    buckets and back: 2 x 100.7 MB. fully_shard, resharding after the forward, copies per
    all-gather the shard in and the whole unit out (twice: forward and backward) and per
    reduce-scatter the whole gradients in and the shard out: (2 + 1) x 100.7 MB x 1.5. Under a
    pipeline that keeps the weights gathered, one gather; resharding, M of everything. At one
    shard a gather is one copy per parameter, and the reduce-scatter still copies in and out.
    Each copied byte is read and written once at the memory bandwidth, in the step's compute."""
    spec, params = describe("fp32"), 25_175_040
    ddp = get_backend("ddp").step_traffic({}, ParallelPlan(dp_replicate=2), spec, params)
    assert ddp.copies == 2 * GRADIENTS
    fsdp = get_backend("fsdp")
    assert fsdp.step_traffic({}, ParallelPlan(dp_shard=2), spec, params).copies == \
        pytest.approx(3 * GRADIENTS * 1.5)
    # one shard (torch's FSDPParamGroup.unshard at world size 1): a gather is each parameter
    # copied from its shard, through no flat output; the reduce-scatter still copies in and out
    alone = fsdp.step_traffic({}, ParallelPlan(dp_shard=1), spec, params)
    assert alone.copies == pytest.approx((2 + 2) * GRADIENTS)
    piped = ParallelPlan(pp=2, dp_shard=2)
    assert fsdp.step_traffic({}, piped, spec, params, 4).copies == \
        pytest.approx(2 * GRADIENTS * 1.5)
    assert fsdp.step_traffic({"reshard_after_forward": True}, piped, spec, params, 4).copies \
        == pytest.approx(4 * 3 * GRADIENTS * 1.5)
    result = _plan(1, 2)
    for label, copied in (("--backend ddp", 2 * GRADIENTS), ("--backend fsdp", 4.5 * GRADIENTS)):
        p = _by_label(result, label)
        bandwidth = _cluster(1, 2).device.memory_bandwidth
        assert p.terms["buffer copies"] == pytest.approx(2 * copied / bandwidth)
        assert p.compute == pytest.approx(p.terms["forward"] + p.terms["backward"]
                                          + p.terms["optimizer step"]
                                          + p.terms["buffer copies"])


def test_layouts_that_price_alike_rank_the_default_backend_first() -> None:
    """One rank: ddp, apex and horovod run the same unwrapped step and price alike; the
    plan's first is mpt's default backend, not the first name in the registry."""
    result = _plan(1, 1)
    alike = [p for p in result.fitting if p.step == result.best.step]
    assert {"--backend ddp", "--backend apex"} <= {p.layout.label for p in alike}
    assert result.best.layout.label == "--backend ddp"


def test_each_bucket_or_unit_is_a_call_that_pays_the_rings_latency() -> None:
    """DDP allreduces the MLP's 100.7 MB in 5 buckets (1 MiB first, then 25 MiB, or
    ``--bucket-mb``), Apex in its 10^7-element messages after the first, Horovod in one fill
    of its 128 MiB fusion buffer, mpt's flat buckets under a pipeline in 25 MiB each; fully_shard
    gathers and reduce-scatters once per unit (the MLP's three Linears; its root holds
    none). Each call pays the ring's steps of latency."""

    spec, net, pair = describe("fp32"), meta_model(mlp), ParallelPlan(dp_replicate=2)

    def calls(backend: str, plan=pair, **comm) -> list[int]:
        flow = get_backend(backend).step_traffic({}, plan, spec, 25_175_040, module=net,
                                                 comm=GradComm(**comm))
        return [c.calls for c in flow.collectives]

    assert calls("ddp") == [5]
    assert calls("ddp", bucket_mb=50) == [1 + 2]
    assert calls("apex") == [1 + 3]
    assert calls("horovod") == [1]
    assert calls("ddp", ParallelPlan(pp=2, dp_replicate=2)) == [4]
    assert calls("ddp", compression="powersgd") == [5, 5, 5]
    assert calls("fsdp", ParallelPlan(dp_shard=2)) == [3, 3, 3]
    cluster = _cluster(2, 1)
    one, five = (collective("all_reduce", GRADIENTS, pair, "dp_replicate", cluster, calls=n)
                 for n in (1, 5))
    assert five.seconds - one.seconds == pytest.approx(4 * 2 * cluster.link.latency)
    assert five.link_bytes == one.link_bytes
