"""One model on one cluster: every layout priced and ranked, and the best one's launch line."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mpt.backends import get_backend
from mpt.errors import UsageError
from mpt.estimate import OPTIMIZER_STATES, parameter_counts
from mpt.parallel import ParallelPlan
from mpt.pipeline.split import stage_blocks
from mpt.plan.cost import (
    Model,
    OwnWork,
    Prediction,
    copy_seconds,
    modelled_compute,
    predict,
)
from mpt.plan.layouts import Refused, layouts
from mpt.plan.network import Cluster
from mpt.plan.profiles import CPU_HOST_MEMORY, BackendStep, MeasuredStep
from mpt.plan.workload import MODEL_ERRORS, profile, refusal, tp_plan_of
from mpt.precision import PrecisionSpec, describe
from mpt.precision.base import dtype_name
from mpt.run_config import RunConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Every layout of a model on a cluster, best first."""

    cluster: Cluster
    """The machines."""
    parameters: int
    """The model's parameters."""
    batch: int
    """Samples per optimizer step over all ranks."""
    precision: str
    """``--precision``."""
    compute: str
    """Where the compute comes from: the ops alone, or scaled by the model's measured step."""
    fitting: tuple[Prediction, ...]
    """Layouts that fit, fastest first."""
    short: tuple[Prediction, ...]
    """Layouts that do not fit, least short first."""
    refused: tuple[Refused, ...]
    """Combinations mpt refuses, with its reason."""

    @property
    def best(self) -> Prediction:
        return self.fitting[0]


def model_of(net: nn.Module, input_shape: Sequence[int], input_dtype: torch.dtype,
             optimizer: str) -> Model:
    """The cost model's view of ``net`` (on meta), profiled lazily per micro-batch size."""

    @functools.cache
    def workload(micro_batch: int) -> Any:
        try:
            return profile(net, input_shape, input_dtype, micro_batch)
        except MODEL_ERRORS as exc:
            raise UsageError("--batch", f"{micro_batch} a micro-batch", f"the model's "
                             f"forward refuses a micro-batch of {micro_batch} sample(s) "
                             f"({refusal(exc)})", "fewer micro-batches, or a larger batch"
                             ) from None

    @functools.cache
    def stages(pp: int) -> list[list[str]]:
        return [[name for name, _ in blocks] for blocks in stage_blocks(net, pp)]

    return Model(net=net, stages=stages, workload=workload, tp_plan=tp_plan_of(net),
                 optimizer_states=OPTIMIZER_STATES[optimizer], optimizer=optimizer)


def measured_scales(model: Model, cluster: Cluster, spec: PrecisionSpec,
                    step: MeasuredStep | None, input_shape: Sequence[int],
                    input_dtype: torch.dtype) -> tuple[dict[str, Any], str]:
    """``Model``'s ``compute_scales``, ``update_seconds`` and ``own_work`` from the
    calibration's timing of this model's own step (matched by its parameters and input), and
    the words that say where the compute comes from. A step timed under another precision
    scales no compute and adds no backend's own work, one of another optimizer no optimizer
    step."""
    parameters = parameter_counts(model.net)[0]
    if step is None or (step.parameters, step.spec.input_shape, step.spec.input_dtype) != (
            parameters, tuple(input_shape), dtype_name(input_dtype)):
        return {}, "op by op"
    timed = step.spec
    found: dict[str, Any] = {}
    used = []
    if timed.precision == spec.name:
        scales = {}
        for pieces, seconds in {1: step.forward_backward, **step.split}.items():
            size = timed.micro_batch // pieces
            scales[size] = seconds / (pieces * modelled_compute(model, cluster, spec, size))
        found["compute_scales"] = scales
        ops = modelled_compute(model, cluster, spec, timed.micro_batch)
        used.append(f"forward + backward {step.forward_backward * 1e3:.1f} ms against "
                    f"{ops * 1e3:.1f} ms op by op (x {scales[timed.micro_batch]:.2f})")
        if step.split:
            used.append("cut into " + ", ".join(
                f"{k} x {timed.micro_batch // k}: x {scales[timed.micro_batch // k]:.2f}"
                for k in sorted(step.split)))
    if timed.optimizer == model.optimizer:
        found["update_seconds"] = step.update / step.parameters
        used.append(f"{timed.optimizer} step {step.update * 1e3:.1f} ms")
    if step.alone and timed.precision == spec.name:
        found["own_work"] = tuple(own_work(alone, model, cluster, spec, step)
                                  for alone in step.alone)
        used.extend(f"--backend {own.backend} {own.options}'s own work "
                    f"{own.per_microbatch * 1e3:.1f} ms a micro-batch + "
                    f"{own.per_step * 1e3:.1f} ms a step" for own in found["own_work"])
    if not used:
        return {}, (f"op by op (the calibration timed {timed.model} under {timed.precision} "
                    f"and {timed.optimizer})")
    return found, (f"op by op, scaled by {timed.model}'s own step at micro-batch "
                   f"{timed.micro_batch}: " + "; ".join(used))


def own_work(alone: BackendStep, model: Model, cluster: Cluster, spec: PrecisionSpec,
             step: MeasuredStep) -> OwnWork:
    """What ``alone``'s backend step added at one rank beyond the plain step and the copies
    the plan prices there: per micro-batch, what its step of two accumulated micro-batches
    took beyond its step of one, less the plain step's and the copies' growth; per step, the
    rest (none where the plain step timed another optimizer: the rest holds the
    optimizer's). The plain step is the one timed beside it, else (files measured before)
    the calibration's (``step``). Where either step was not timed in two pieces, all of it
    is per step."""
    cls = get_backend(alone.backend)
    parameters = parameter_counts(model.net)[0]
    copies = [copy_seconds(cls.step_traffic(alone.options, ParallelPlan(), spec, parameters, a,
                                            module=model.net), cluster) for a in (1, 2)]
    if alone.plain is not None:
        plain, two = alone.plain, alone.plain_accumulated
    else:  # a file measured before: the calibration's own plain step
        half = step.split.get(2)
        plain = step.forward_backward + step.update
        two = None if half is None else half + step.update
    per_microbatch = 0.0 if two is None or alone.accumulated is None else max(0.0, (
        alone.accumulated - alone.step - (two - plain) - (copies[1] - copies[0])))
    rest = alone.step - plain - copies[0] - per_microbatch
    return OwnWork(backend=alone.backend, options=alone.options, per_microbatch=per_microbatch,
                   per_step=max(0.0, rest) if step.spec.optimizer == model.optimizer else 0.0)


def measured_model(net: nn.Module, cluster: Cluster, spec: PrecisionSpec,
                   input_shape: Sequence[int], input_dtype: torch.dtype, optimizer: str,
                   step: MeasuredStep | None) -> tuple[Model, str]:
    """``model_of`` ``net`` with ``measured_scales`` of ``step`` applied, and the words that
    say where its compute comes from."""
    model = model_of(net, input_shape, input_dtype, optimizer)
    scales, compute = measured_scales(model, cluster, spec, step, input_shape, input_dtype)
    return dataclasses.replace(model, **scales), compute


def plan(net: nn.Module, cluster: Cluster, *, precision: str, batch: int,
         input_shape: Sequence[int], input_dtype: torch.dtype, optimizer: str = "adam",
         step: MeasuredStep | None = None) -> Plan:
    """Price every layout (the compute scaled by ``step``, the calibration's timing of this
    model's own step, where it is this model's); a UsageError where none fits, naming the
    smallest shortfall."""
    if batch < 1:
        raise UsageError("--batch", batch, "it must be at least 1", "pass the global batch")
    spec = describe(precision)
    model, compute = measured_model(net, cluster, spec, input_shape, input_dtype, optimizer,
                                    step)
    found, refused = layouts(net, nodes=cluster.nodes, gpus=cluster.gpus, precision=precision,
                             batch=batch, device_type=cluster.device.device_type)
    predictions = []
    for layout in found:
        try:
            predictions.append(predict(layout, model, cluster, spec))
        except UsageError as exc:  # a micro-batch the model refuses
            refused.append(Refused(flags=layout.flags, reason=str(exc)))
    # equal steps (whole replicas on one rank: ddp, apex, horovod) rank mpt's default first
    default = RunConfig().backend
    fitting = sorted((p for p in predictions if not p.short),
                     key=lambda p: (p.step, p.layout.backend != default))
    short = sorted((p for p in predictions if p.short), key=lambda p: p.short)
    result = Plan(cluster=cluster, parameters=parameter_counts(net)[0], batch=batch,
                  precision=precision, compute=compute, fitting=tuple(fitting), short=tuple(short),
                  refused=tuple(refused))
    if not fitting:
        _refuse_unfit(result)
    return result


def _refuse_unfit(result: Plan) -> None:
    """No layout fits: name the closest and what it lacks."""
    if not result.short:
        reason = result.refused[0].reason if result.refused else "no combination"
        raise UsageError("--nodes/--gpus", f"{result.cluster.nodes}x{result.cluster.gpus}",
                         f"mpt runs no layout of this model there ({reason})",
                         "change the cluster or --batch")
    closest = result.short[0]
    need = closest.total_memory / 2**30
    host = (f" and {closest.memory.row.host / 2**30:.2f} GiB of host memory"
            if closest.host_short else "")
    raise UsageError("--nodes/--gpus", f"{result.cluster.nodes}x{result.cluster.gpus}",
                     f"no layout fits in {result.cluster.device.memory / 2**30:.1f} GiB per "
                     f"rank: the closest, {closest.layout.label}, needs {need:.2f} GiB per rank "
                     f"of its fullest stage{host} ({closest.short / 2**30:.2f} GiB short)",
                     "add nodes or GPUs, a device with more memory, or a smaller --batch")


def launch_line(prediction: Prediction, cluster: Cluster, script: str, batch: int,
                precision: str) -> str:
    """The `mpt launch` command of ``prediction``'s layout (node 0's, where several)."""
    parts = ["mpt launch", f"--nodes {cluster.nodes}", f"--gpus {cluster.gpus}"]
    if cluster.nodes > 1:
        parts.append("--nr 0")
    parts += [*prediction.layout.flags, f"--precision {precision}",
              f"--global-batch-size {batch}"]
    if cluster.device.device_type == "cpu":
        parts.append(f"--host-memory {CPU_HOST_MEMORY}")
    return " ".join([*parts, script])
