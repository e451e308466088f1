"""A calibration that timed the model's own step: what the plan scales its compute and its
optimizer step by, matched to the model it was timed for."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics

import pytest
import torch
from plan_models import mlp

from mpt.estimate import meta_model
from mpt.plan.cost import modelled_compute
from mpt.plan.network import Cluster
from mpt.plan.planner import model_of, plan
from mpt.plan.profiles import Device, MeasuredStep, StepSpec, link_profile
from mpt.precision import describe

PARAMETERS = 25_175_040


def _cluster() -> Cluster:
    device = Device(name="calibrated", flops={"float32": 100e9}, memory_bandwidth=20e9,
                    memory=64e9, intra_node=link_profile("10gbit"), device_type="cpu",
                    update_seconds={"sgd-momentum": 1e-9})
    return Cluster(nodes=1, gpus=2, device=device, link=link_profile("1gbit"))


def _step(forward_backward: float, parameters: int = PARAMETERS, **changes) -> MeasuredStep:
    spec = {"model": "plan_models.py:mlp", "input_shape": (1024,), "input_dtype": "float32",
            "micro_batch": 8, "precision": "fp32", "optimizer": "sgd-momentum"}
    return MeasuredStep(spec=StepSpec(**{**spec, **changes}), parameters=parameters,
                        forward_backward=forward_backward, update=0.02)


def _ddp(per_rank: int, step: MeasuredStep | None, precision: str = "fp32"):
    result = plan(meta_model(mlp), _cluster(), precision=precision, batch=2 * per_rank,
                  input_shape=[1024], input_dtype=torch.float32, optimizer="sgd-momentum",
                  step=step)
    return result, next(p for p in result.fitting if p.layout.label == "--backend ddp")


def _ops(micro_batch: int, precision: str = "fp32") -> float:
    model = model_of(meta_model(mlp), [1024], torch.float32, "sgd-momentum")
    return modelled_compute(model, _cluster(), describe(precision), micro_batch)


def _tiny(tmp_path) -> StepSpec:
    """A small model written to ``tmp_path`` and the step a calibration times of it."""
    (tmp_path / "tiny.py").write_text(
        "from torch import nn\n\ndef build():\n"
        "    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))\n")
    return StepSpec(model=f"{tmp_path}/tiny.py:build", input_shape=(16,),
                    input_dtype="float32", micro_batch=4, precision="fp32", optimizer="adamw")


def _through_file(figures: dict, tmp_path) -> MeasuredStep | None:
    """The plan's MeasuredStep of a model step's ``figures``, saved in a calibration file and
    loaded back."""
    from mpt.plan import calibrate

    path = tmp_path / "cal.json"
    fit = {"latency": 1e-4, "bus_bandwidth": 1e9}
    calibrate.save(calibrate.Calibration(
        identity=calibrate.identity(), ranks=2, backend="gloo", flops={"float32": 1e11},
        memory_bandwidth=1e10, op_overhead=1e-6, memory=1e10, collectives={"all_reduce": fit},
        matmul_sweep={}, update_seconds={}, model_step=figures), path)
    return calibrate.load(path).measured_step()


def test_the_measured_step_is_the_compute_at_its_micro_batch_and_scales_the_others() -> None:
    measured = 2.5 * _ops(8)
    step = _step(forward_backward=measured)
    result, at_8 = _ddp(8, step)
    assert at_8.terms["forward"] + at_8.terms["backward"] == pytest.approx(measured)
    assert at_8.terms["optimizer step"] == pytest.approx(0.02)  # every parameter, per rank
    assert "scaled by plan_models.py:mlp's own step at micro-batch 8" in result.compute
    _, at_2 = _ddp(2, step)
    assert at_2.terms["forward"] + at_2.terms["backward"] == pytest.approx(2.5 * _ops(2))
    _, alone = _ddp(8, None)
    assert alone.terms["forward"] + alone.terms["backward"] == pytest.approx(_ops(8))
    assert alone.terms["optimizer step"] == pytest.approx(PARAMETERS * 1e-9)


def test_the_step_cut_into_pieces_prices_the_smaller_micro_batches() -> None:
    """A micro-batch of 4 is priced at what 8 samples cut in 2 accumulated pieces measured,
    per piece, one of 2 at 4 pieces' share; 3 between them (the log of the size), 1 as 2 (the
    smallest timed)."""
    step = dataclasses.replace(_step(forward_backward=2.5 * _ops(8)),
                               split={2: 2 * 3.0 * _ops(4), 4: 4 * 4.0 * _ops(2)})

    def compute(per_rank: int) -> float:
        found = _ddp(per_rank, step)[1]
        return found.terms["forward"] + found.terms["backward"]

    assert compute(8) == pytest.approx(2.5 * _ops(8))
    assert compute(4) == pytest.approx(3.0 * _ops(4))
    assert compute(2) == pytest.approx(4.0 * _ops(2))
    at_3 = 4.0 + math.log(3 / 2) / math.log(4 / 2) * (3.0 - 4.0)  # from 2's scale to 4's
    assert compute(3) == pytest.approx(at_3 * _ops(3))
    assert compute(1) == pytest.approx(4.0 * _ops(1))


@pytest.mark.parametrize(("changes", "scaled", "updated"), [
    ({"parameters": PARAMETERS + 1}, False, False),  # another model
    ({"input_shape": (512,)}, False, False),
    ({"precision": "bf16-mixed"}, False, True),  # its compute is another precision's
    ({"optimizer": "adamw"}, True, False),
])
def test_a_step_timed_for_another_model_precision_or_optimizer_is_not_used(
        changes, scaled, updated) -> None:
    step = _step(forward_backward=3 * _ops(8), **changes)
    result, found = _ddp(8, step)
    compute = found.terms["forward"] + found.terms["backward"]
    assert compute == pytest.approx(3 * _ops(8) if scaled else _ops(8))
    assert found.terms["optimizer step"] == pytest.approx(0.02 if updated else PARAMETERS * 1e-9)
    assert result.compute.startswith("op by op")


def test_the_calibration_times_a_models_own_step_and_keeps_it(tmp_path) -> None:
    """ModelStep on this process's CPU: a real forward, backward and optimizer step, timed in
    two spells whose medians the figures keep; they survive the file and come back as the
    plan's MeasuredStep."""
    from mpt.plan import calibrate

    spec = _tiny(tmp_path)
    aligned = []  # each timed part begins once the ranks that train at once are aligned
    model = calibrate.ModelStep(spec, torch.device("cpu"), lambda: None,
                                lambda: aligned.append(1))
    model.time()
    model.time(3)
    # the micro-batch of 4 whole, and cut into 2 and 4 pieces (8 and 16 do not divide it)
    assert {k: len(t) for k, t in model.timings.items()} == {
        1: calibrate.STEP_REPEATS + 3, 2: calibrate.STEP_REPEATS + 3,
        4: calibrate.STEP_REPEATS + 3}
    assert len(model.updates) == calibrate.STEP_REPEATS + 3
    # a forward and backward and an update per piece count, warm-up steps too
    assert len(aligned) == 2 * 3 * (calibrate.STEP_WARMUP + calibrate.STEP_REPEATS + 3)
    figures = model.figures()
    assert figures["parameters"] == 16 * 32 + 32 + 32 * 2 + 2
    assert figures["forward_backward"] == statistics.median(model.timings[1]) > 0
    assert figures["update"] == statistics.median(model.updates) > 0
    assert figures["split"] == {str(k): statistics.median(model.timings[k]) for k in (2, 4)}
    assert _through_file(figures, tmp_path) == MeasuredStep(
        spec=spec, parameters=figures["parameters"],
        forward_backward=figures["forward_backward"], update=figures["update"],
        split={k: figures["split"][str(k)] for k in (2, 4)})


def test_a_model_that_refuses_its_input_is_kept_as_an_error(tmp_path) -> None:
    """A RuntimeError in the warm-up (here, an input of the wrong width) ends the timing: later
    spells do nothing, and the figures carry the error's first line instead of medians."""
    from mpt.plan import calibrate

    (tmp_path / "tiny.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Linear(16, 2)\n")
    spec = StepSpec(model=f"{tmp_path}/tiny.py:build", input_shape=(5,), input_dtype="float32",
                    micro_batch=4, precision="fp32", optimizer="sgd")
    model = calibrate.ModelStep(spec, torch.device("cpu"), lambda: None)
    model.time()
    assert model.timings == {1: [], 2: [], 4: []} and model.updates == []
    figures = model.figures()
    assert list(figures) == ["error"] and figures["error"].startswith("RuntimeError: ")


def test_pieces_the_model_refuses_are_not_timed(tmp_path) -> None:
    """Batch norm refuses a piece of one sample (a ValueError): a micro-batch of 4 is timed
    whole and in 2 pieces, not in 4; a micro-batch of one sample is kept as an error."""
    from mpt.plan import calibrate

    (tmp_path / "normed.py").write_text(
        "from torch import nn\n\ndef build():\n"
        "    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8))\n")
    spec = StepSpec(model=f"{tmp_path}/normed.py:build", input_shape=(6,),
                    input_dtype="float32", micro_batch=4, precision="fp32", optimizer="sgd")
    model = calibrate.ModelStep(spec, torch.device("cpu"), lambda: None)
    model.time()
    assert model.splits == [1, 2]
    assert set(model.figures()["split"]) == {"2"}
    one = calibrate.ModelStep(dataclasses.replace(spec, micro_batch=1), torch.device("cpu"),
                              lambda: None)
    assert one.figures()["error"].startswith("ValueError: Expected more than 1 value")


def test_token_ids_and_a_cast_model_are_timed_in_their_own_dtypes(tmp_path) -> None:
    """Token ids run as ids (an embedding refuses floats), and a model cast to bf16 (O2) is
    fed its float samples in bf16 by the precision's own hook (a bf16 Linear refuses fp32)."""
    from mpt.plan import calibrate

    (tmp_path / "models.py").write_text(
        "from torch import nn\n\ndef tokens():\n"
        "    return nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 6, 50))\n"
        "\ndef features():\n"
        "    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))\n")
    for name, dtype, parameters in (("tokens", "int64", 50 * 8 + 48 * 50 + 50),
                                    ("features", "float32", 6 * 16 + 16 + 2 * 16 + 16 * 2 + 2)):
        spec = StepSpec(model=f"{tmp_path}/models.py:{name}", input_shape=(6,),
                        input_dtype=dtype, micro_batch=3, precision="O2-bf16", optimizer="sgd")
        model = calibrate.ModelStep(spec, torch.device("cpu"), lambda: None)
        model.time()
        figures = model.figures()
        assert figures["parameters"] == parameters
        assert figures["forward_backward"] > 0 and figures["update"] > 0


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """One 2-rank gloo job's timings (plan_aligned.py)."""
    from conftest import find_free_port
    from plan_aligned import measure

    return measure(find_free_port())


def test_each_timing_begins_on_every_measuring_rank_at_once(two_ranks) -> None:
    """Two gloo processes, rank 0's work 1 ms and rank 1's 40: aligned by a barrier, rank 0
    begins each run with rank 1 (40 ms apart), while its timings leave the wait out; alone, it
    runs its own five in a few ms."""
    from plan_aligned import LONG, SHORT

    found = two_ranks
    aligned, alone = found["aligned"], found["alone"]
    gaps = [b - a for a, b in itertools.pairwise(aligned["starts"][1:])]  # the timed runs
    assert len(gaps) == 4 and min(gaps) > 0.75 * LONG, gaps
    assert SHORT <= aligned["median"] < LONG / 2
    assert alone["starts"][-1] - alone["starts"][0] < LONG


def test_fsdp_layouts_pay_fully_shards_own_work_as_timed_at_one_rank() -> None:
    """fsdp's step timed at one rank beyond the plain step and the copies the plan prices
    there is fully_shard's own work: every fsdp layout pays it (offloaded, resharded, under a
    pipeline its stage's share), no other backend does, and a step of another precision adds
    none."""
    from mpt.backends import get_backend
    from mpt.parallel import ParallelPlan
    from mpt.plan.cost import copy_seconds
    from mpt.plan.profiles import BackendStep

    net = meta_model(mlp)
    copies = [copy_seconds(get_backend("fsdp").step_traffic(
        {}, ParallelPlan(), describe("fp32"), PARAMETERS, a, module=net), _cluster())
        for a in (1, 2)]
    hooks, dtensors = 0.004, 0.003  # a micro-batch's, the optimizer step's
    plain = dataclasses.replace(_step(forward_backward=0.05), split={2: 0.06})
    alone = BackendStep(backend="fsdp", options={},
                        step=0.05 + 0.02 + copies[0] + hooks + dtensors,
                        accumulated=0.06 + 0.02 + copies[1] + 2 * hooks + dtensors)
    step = dataclasses.replace(plain, alone=(alone,))

    def own_work(label: str, changed: MeasuredStep = step) -> float:
        result = plan(net, _cluster(), precision="fp32", batch=16, input_shape=[1024],
                      input_dtype=torch.float32, optimizer="sgd-momentum", step=changed)
        return next(p for p in (*result.fitting, *result.short) if p.layout.label == label
                    ).terms["the backend's own work"]

    assert own_work("--backend fsdp") == pytest.approx(hooks + dtensors)
    assert own_work("--backend fsdp --accumulate 4") == pytest.approx(4 * hooks + dtensors)
    assert own_work("--backend fsdp --fsdp-cpu-offload") == pytest.approx(hooks + dtensors)
    assert own_work("--backend ddp") == own_work("--backend deepspeed --zero-stage 3") == 0
    # a pipeline stage pays its share of the model's parameters (the slower stage's)
    sizes = dict(net.named_parameters())
    shares = [sum(p.numel() for name, p in sizes.items() if name.split(".")[0] in blocks)
              / PARAMETERS for blocks in model_of(net, [1024], torch.float32, "sgd").stages(2)]
    staged = own_work("--backend fsdp --pipeline-stages 2 --microbatches 2")
    assert any(staged == pytest.approx(share * (2 * hooks + dtensors)) for share in shares)
    assert 0 < min(shares) < max(shares) < 1
    assert own_work("--backend fsdp", plain) == 0
    other = dataclasses.replace(step, spec=dataclasses.replace(step.spec, precision="bf16-mixed"))
    assert own_work("--backend fsdp", other) == 0
    # timed beside a plain step of its own (in a spell 50 % slower than the calibration's),
    # the difference of the two is what it adds
    slow = dataclasses.replace(alone, step=1.5 * (0.05 + 0.02) + copies[0] + hooks + dtensors,
                               accumulated=1.5 * (0.06 + 0.02) + copies[1] + 2 * hooks
                               + dtensors, plain=1.5 * 0.07, plain_accumulated=1.5 * 0.08)
    paired = dataclasses.replace(step, alone=(slow,))
    assert own_work("--backend fsdp", paired) == pytest.approx(hooks + dtensors)
    assert own_work("--backend fsdp --accumulate 4", paired) == pytest.approx(
        4 * hooks + dtensors)


def test_a_file_with_fully_shards_step_over_a_mesh_still_loads(tmp_path) -> None:
    """Files measured before fsdp's step was timed alone hold it as ``sharded``: the plan
    reads the rest, and its fsdp layouts pay no own work from them."""
    figures = {"spec": dataclasses.asdict(_step(0.05).spec), "parameters": PARAMETERS,
               "forward_backward": 0.05, "update": 0.02, "split": {},
               "sharded": {"forward_backward": 0.09, "update": 0.03}}
    step = _through_file(figures, tmp_path)
    assert step is not None and step.forward_backward == 0.05 and step.alone == ()


def test_zero_3_layouts_pay_its_own_work_as_timed_at_one_rank() -> None:
    """DeepSpeed ZeRO-3's step timed at one rank, whole and as two accumulated micro-batches:
    what the second micro-batch added beyond the plain step's growth and the copies' is paid
    per micro-batch, the rest beyond the plain step and the copies once a step, by every
    ZeRO-3 layout (offloaded too) and no other; a step timed in another precision adds
    none."""
    from mpt.backends import get_backend
    from mpt.parallel import ParallelPlan
    from mpt.plan.cost import copy_seconds
    from mpt.plan.profiles import BackendStep

    net = meta_model(mlp)
    copies = [copy_seconds(get_backend("deepspeed").step_traffic(
        {"zero_stage": 3}, ParallelPlan(), describe("fp32"), PARAMETERS, a, module=net),
        _cluster()) for a in (1, 2)]
    hooks, once = 0.006, 0.004  # a micro-batch's, a step's
    plain = dataclasses.replace(_step(forward_backward=0.05), split={2: 0.06})
    alone = BackendStep(backend="deepspeed", options={"zero_stage": 3},
                        step=0.05 + 0.02 + copies[0] + hooks + once,
                        accumulated=0.06 + 0.02 + copies[1] + 2 * hooks + once)
    step = dataclasses.replace(plain, alone=(alone,))

    def own_work(label: str, changed: MeasuredStep = step) -> float:
        result = plan(net, _cluster(), precision="fp32", batch=16, input_shape=[1024],
                      input_dtype=torch.float32, optimizer="sgd-momentum", step=changed)
        return next(p for p in (*result.fitting, *result.short) if p.layout.label == label
                    ).terms["the backend's own work"]

    zero3 = "--backend deepspeed --zero-stage 3"
    assert own_work(zero3) == pytest.approx(hooks + once)
    assert own_work(zero3 + " --accumulate 4") == pytest.approx(4 * hooks + once)
    assert own_work(zero3 + " --offload optimizer") == pytest.approx(hooks + once)
    for other in ("--backend deepspeed --zero-stage 2", "--backend ddp", "--backend fsdp"):
        assert own_work(other) == 0, other
    assert own_work(zero3, plain) == 0
    # an odd micro-batch is not cut in two: all of it is paid once a step
    odd = dataclasses.replace(step, alone=(dataclasses.replace(alone, accumulated=None),))
    assert own_work(zero3 + " --accumulate 4", odd) == pytest.approx(hooks + once)
    bf16 = dataclasses.replace(step, spec=dataclasses.replace(step.spec, precision="bf16-mixed"))
    assert own_work(zero3, bf16) == 0


def test_the_calibration_times_fsdp_and_zero_3_alone_and_keeps_them(tmp_path) -> None:
    """``alone_steps``: fsdp's fully_shard and DeepSpeed ZeRO-3 really train the model
    through mpt.Runtime in processes of their own, at one rank, whole and as two accumulated
    micro-batches; the figures survive the file as the plan's MeasuredStep.alone."""
    from mpt.plan import calibrate
    from mpt.plan.profiles import BackendStep

    spec = _tiny(tmp_path)
    found = calibrate.alone_steps(spec, 1)
    assert sorted((f["backend"], str(f["options"])) for f in found) == [
        ("deepspeed", "{'zero_stage': 3}"), ("fsdp", "{}")]
    assert all(f["accumulated"] > 0 and f["step"] > 0 for f in found)
    # each beside a plain step of the model, timed in the same process
    assert all(f["plain"] > 0 and f["plain_accumulated"] > 0 for f in found)
    model = calibrate.ModelStep(spec, torch.device("cpu"), lambda: None)
    model.time(1)
    step = _through_file({**model.figures(), "alone": found}, tmp_path)
    assert step is not None and step.alone == tuple(BackendStep(**f) for f in found)
