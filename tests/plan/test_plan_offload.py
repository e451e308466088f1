"""Offloaded layouts in `mpt plan`: fsdp's ``--fsdp-cpu-offload`` and DeepSpeed's
``--offload``, what they move between host and device, where they step, what they keep."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from plan_models import mlp

from mpt.backends import get_backend
from mpt.estimate import meta_model
from mpt.parallel import ParallelPlan
from mpt.plan.calibrate import OPTIMIZERS, host_figures
from mpt.plan.cost import Prediction, predict
from mpt.plan.layouts import layout
from mpt.plan.network import Cluster
from mpt.plan.planner import model_of, plan
from mpt.plan.profiles import Device, device_profile, link_profile
from mpt.precision import describe

P = 25_175_040  # the MLP's parameters
TWO = ParallelPlan(dp_shard=2)


def _traffic(backend: str, precision: str = "fp32", microbatches: int = 1, **options):
    return get_backend(backend).step_traffic(options, TWO, describe(precision), float(P),
                                             microbatches)


def test_each_offload_says_what_crosses_between_host_and_device() -> None:
    """fsdp fetches its fp32 shard for each gather (the forward's and, resharded, the
    backward's) and sends each reduced gradient shard back; DeepSpeed sends its partition's
    gradients to the host in fp32 and brings the update back in its mode's dtype, or, with
    the weights offloaded, fetches the partition for each gather instead."""
    shard = 4 * P / 2
    fsdp = _traffic("fsdp", cpu_offload=True)
    assert fsdp.host_copies == pytest.approx(3 * shard) and fsdp.steps_on_host
    assert _traffic("fsdp", microbatches=4, cpu_offload=True).host_copies == pytest.approx(
        9 * shard)  # gathered twice in each of 4 micro-batches, reduced in the last
    assert _traffic("fsdp", "bf16-mixed", cpu_offload=True).host_copies == pytest.approx(
        3 * shard)  # the shards are fp32 masters under autocast too
    assert _traffic("deepspeed", zero_stage=1, offload="optimizer").host_copies == (
        pytest.approx((4 + 4) * P / 2))
    assert _traffic("deepspeed", "bf16-mixed", zero_stage=2, offload="optimizer"
                    ).host_copies == pytest.approx((4 + 2) * P / 2)
    both = _traffic("deepspeed", "bf16-mixed", zero_stage=3, offload="optimizer,parameters")
    # one gather a micro-batch: the backward reuses what the forward gathered
    assert both.host_copies == pytest.approx(4 * P / 2 + 2 * P / 2) and both.steps_on_host
    for kept in (_traffic("fsdp"), _traffic("deepspeed", zero_stage=3)):
        assert kept.host_copies == 0 and not kept.steps_on_host


def _cpu() -> Device:
    return Device(name="host", flops={"float32": 1e11}, memory_bandwidth=1e10, memory=64e9,
                  intra_node=link_profile("10gbit"), device_type="cpu",
                  update_seconds={"adam": 2e-9})


def _predict(device: Device, backend: str, **options) -> Prediction:
    net = meta_model(mlp)
    chosen = layout(net, backend, options, 1, 1, world=2, precision="fp32", batch=32)
    return predict(chosen, model_of(net, [1024], torch.float32, "adam"),
                   Cluster(nodes=1, gpus=2, device=device, link=link_profile("1gbit")),
                   describe("fp32"))


@pytest.mark.parametrize(("backend", "options"), [
    ("fsdp", {"cpu_offload": True}), ("deepspeed", {"zero_stage": 2, "offload": "optimizer"}),
    ("deepspeed", {"zero_stage": 3, "offload": "optimizer,parameters"})])
def test_beside_a_gpu_an_offload_pays_the_host_link_and_steps_on_the_host(
        backend: str, options: dict) -> None:
    """On the H100's datasheet: the copies at PCIe Gen5's 64 GB/s each way, Adam's bytes at
    the host's assumed 76.8 GB/s, its state off the device, its temporaries on the host."""
    device = device_profile("h100-sxm")
    moved = _predict(device, backend, **options)
    kept = _predict(device, backend, **{k: v for k, v in options.items() if k == "zero_stage"})
    flow = get_backend(backend).step_traffic(options, TWO, describe("fp32"), float(P))
    assert moved.terms["host-device copies"] == pytest.approx(flow.host_copies / 64e9)
    assert moved.terms["optimizer step"] == pytest.approx(P / 2 * 28 / 76.8e9)
    assert kept.terms["host-device copies"] == 0
    assert moved.memory.row.host > 0 and moved.memory.offloaded == 0
    assert moved.memory.row.optimizer == 0 < kept.memory.row.optimizer
    assert moved.memory.transient == 0 < kept.memory.transient
    assert moved.total_memory < kept.total_memory


def test_on_a_cpu_an_offload_moves_nothing_and_keeps_its_bytes() -> None:
    """A CPU rank's memory is the host's: fsdp's offload copies nothing, steps as it would,
    and what it offloads stays in the rank's peak (fully_shard then holds the same);
    DeepSpeed's still copies through its own host buffers, at the memory bandwidth."""
    moved = _predict(_cpu(), "fsdp", cpu_offload=True)
    kept = _predict(_cpu(), "fsdp")
    assert moved.terms["host-device copies"] == 0
    assert moved.terms["optimizer step"] == kept.terms["optimizer step"] == pytest.approx(
        P / 2 * 2e-9)
    assert moved.memory.offloaded == moved.memory.row.host > 0
    assert moved.total_memory == kept.total_memory
    options = {"zero_stage": 1, "offload": "optimizer"}
    buffered = _predict(_cpu(), "deepspeed", **options)
    flow = get_backend("deepspeed").step_traffic(options, TWO, describe("fp32"), float(P))
    assert flow.host_buffers
    assert buffered.terms["host-device copies"] == pytest.approx(2 * flow.host_copies / 1e10)
    assert buffered.terms["optimizer step"] == pytest.approx(P / 2 * 2e-9)


def test_offload_fits_a_model_that_nothing_else_fits() -> None:
    """On a device just too small for every layout that keeps its state there, the plan
    ranks the offloaded ones, and its best launch line offloads."""
    device = device_profile("h100-sxm")

    def ranked(memory: float):
        cluster = Cluster(nodes=1, gpus=2, device=replace(device, memory=memory),
                          link=link_profile("100gbit"))
        return plan(meta_model(mlp), cluster, precision="fp32", batch=16,
                    input_shape=[1024], input_dtype=torch.float32, optimizer="adam")

    everything = ranked(device.memory)
    offloads = [p for p in everything.fitting if "offload" in p.layout.label]
    assert {p.layout.label for p in offloads} >= {
        "--backend fsdp --fsdp-cpu-offload",
        "--backend deepspeed --zero-stage 1 --offload optimizer",
        "--backend deepspeed --zero-stage 3 --offload optimizer,parameters"}
    least = min(p.total_memory for p in offloads)
    others = min(p.total_memory for p in everything.fitting if p not in offloads)
    assert least < others
    squeezed = ranked((least + others) / 2)
    assert squeezed.fitting and all("offload" in p.layout.label for p in squeezed.fitting)
    assert "offload" in squeezed.best.layout.label
    kept = {p.layout.label for p in everything.fitting if p not in offloads}
    assert kept <= {p.layout.label for p in squeezed.short}


def test_a_cpu_calibration_measures_no_host_link() -> None:
    """On a CPU, nothing lies between host and device: no figures, which the device then
    reads as copies that cost nothing."""
    assert host_figures(torch.device("cpu"), lambda: None) == {}


@pytest.mark.gpu
def test_beside_a_gpu_the_calibration_times_the_host_link_and_the_host_step() -> None:
    device = torch.device("cuda", 0)
    found = host_figures(device, lambda: torch.cuda.synchronize(device))
    assert 1e9 < found["host_link"] < 1e12  # PCIe or NVLink-C2C, each way
    assert set(found["host_update_seconds"]) == set(OPTIMIZERS)
    assert all(seconds > 0 for seconds in found["host_update_seconds"].values())


def test_what_a_rank_offloads_must_fit_in_its_host_memory() -> None:
    """Beside a GPU the offloaded bytes go to the host's memory: where a rank's share of it is
    smaller, the layout does not fit, and says that host memory is what it lacks."""
    device = replace(device_profile("h100-sxm"), host_memory=1e6)
    moved = _predict(device, "fsdp", cpu_offload=True)
    assert moved.host_short == moved.memory.row.host - 1e6 > 0
    assert moved.short == moved.host_short and moved.limiter.startswith("host memory: ")
    assert _predict(device, "fsdp").short == 0  # nothing offloaded: the host is not asked
    assert _predict(_cpu(), "fsdp", cpu_offload=True).host_short == 0  # in the rank's peak
