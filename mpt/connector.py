"""Resolve a worker's settings, once: what `mpt launch` handed over, the Runtime's arguments on
top, and everything that follows from them (device, topology, batch plan, precision, backend).

The Runtime only wires what ``connect`` returns, so the order of these decisions (the topology
before the batch plan, the batch plan before the backend, which divides by its accumulation)
lives in one place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from mpt.backends import Backend, Topology, checked_precision, get_backend
from mpt.environments import World, detect_world, device_name
from mpt.environments.host_memory import apply_host_memory
from mpt.pipeline.stages import Stages
from mpt.pipeline.state import StagedState
from mpt.pipeline.step import PipelineStep
from mpt.precision import LossScaleConfig, Precision
from mpt.run_config import RunConfig
from mpt.scaling import BatchPlan, lr_factor, plan_batch
from mpt.step import TrainStep

if TYPE_CHECKING:
    from mpt.checkpoint.state import StateHolder


@dataclass(frozen=True, kw_only=True, slots=True)
class Connection:
    """One worker's resolved run: who it is, what it trains with, and its backend (not yet
    joined to the others)."""

    config: RunConfig
    """Every run setting, as this process trains with it."""
    world: World
    """This process's place in the job."""
    device: torch.device
    """Where its model and batches live."""
    topology: Topology
    """Its place in the backend's layout: the data-parallel rank and size."""
    batch_plan: BatchPlan | None
    """How the global batch splits over replicas and micro-batches (None: no global size)."""
    accumulate: int
    """Micro-batches per optimizer step."""
    batch_size: int | None
    """Per-rank micro-batch size to build the DataLoader with (None: the script decides)."""
    precision: Precision
    backend: Backend
    """Joins the processes and keeps the replicas equal: the whole job's, or, under a
    pipeline, each stage's over its replicas."""
    stages: Stages | None = None
    """This rank's pipeline stage of the model (None: no pipeline)."""
    host_memory_note: str | None = None
    """Why ``--host-memory`` had no effect in this process (None: it took effect)."""

    @property
    def state(self) -> StateHolder:
        """What checkpoints save and restore the training state through."""
        return self.backend if self.stages is None else StagedState(self.stages)

    def make_step(self, **parts: Any) -> TrainStep:
        """What runs ``rt.backward``/``rt.forward_backward``/``rt.clip_grad_norm_``/``rt.step``
        (``parts``: ``TrainStep``'s arguments): a pipeline's schedule where there is one."""
        if self.stages is None:
            return TrainStep(backend=self.backend, **parts)
        return PipelineStep(backend=self.backend, stages=self.stages, **parts)

    def notes(self) -> list[str]:
        """What rank 0 says of the run at start: how the batch splits, how rates scale, a
        memory setting this machine cannot apply."""
        lines = [] if self.batch_plan is None else [f"mpt: {self.batch_plan.describe()}"]
        if self.host_memory_note is not None:
            lines.append(self.host_memory_note)
        rule, replicas = self.config.lr_scaling, self.topology.dp_size
        if rule is not None:
            lines.append(f"mpt: lr scaling {rule}: rt.scale_lr multiplies learning rates by "
                         f"{lr_factor(rule, replicas):g} (data-parallel size {replicas})")
        return lines


def connect(env: Mapping[str, str], config: RunConfig | None = None, *,
            batch_size: int | None = None, **settings: Any) -> Connection:
    """The run ``config`` describes (default: `env`, `mpt launch`'s hand-off), with
    ``settings`` (``RunConfig`` fields by name; None keeps a value) on top, both checked by
    ``RunConfig`` whichever way they came."""
    world = detect_world(env)
    loss_scale, timeout = settings.pop("loss_scale", None), settings.pop("timeout", None)
    config = (RunConfig.from_env(env) if config is None else config).replace(
        loss_scale=None if isinstance(loss_scale, LossScaleConfig) else loss_scale,
        timeout=timeout.total_seconds() if isinstance(timeout, timedelta) else timeout,
        **{name: os.fspath(value) if isinstance(value, os.PathLike) else value
           for name, value in settings.items()})
    # Before the Runtime allocates anything of the model, so the whole run gets it.
    host_memory_note = apply_host_memory(config.host_memory)
    device = torch.device(device_name(world.local_rank, torch.cuda.is_available()))
    backend_class = get_backend(config.backend)
    layout = config.layout(world.world_size)
    pipeline = config.pipeline_at(world.world_size)
    topology = Topology(plan=layout, rank=world.rank, computes_loss=pipeline is None or (
        pipeline.holder(pipeline.chunks - 1) == layout.stage(world.rank)))
    total = config.global_batch_size
    plan = None if total is None else plan_batch(total, topology.dp_size, batch_size=batch_size,
                                                 accumulate=config.accumulate)
    accumulate = plan.accumulate if plan else config.accumulate or 1
    if plan is not None:
        batch_size = plan.batch_size
    elif batch_size is None:
        batch_size = backend_class.default_batch_size(config.backend_options, accumulate,
                                                      topology.dp_size)
    scale = (loss_scale if isinstance(loss_scale, LossScaleConfig)
             else LossScaleConfig.parse(config.loss_scale))
    # The check `mpt launch` made, again for scripts other launchers started.
    precision = checked_precision(
        config.backend, config.precision, device_type=device.type, loss_scale=scale,
        precision_options=config.precision_options, backend_options=config.backend_options)
    backend = backend_class(world=world, device=device, precision=precision,
                            accumulate=accumulate, timeout=timedelta(seconds=config.timeout
                                                                     or 1800.0),
                            options=config.backend_options, comm=config.grad_comm,
                            layout=layout)
    return Connection(config=config, world=world, device=device, topology=topology,
                      batch_plan=plan, accumulate=accumulate,
                      batch_size=batch_size, precision=precision, backend=backend,
                      stages=None if pipeline is None else Stages(backend, pipeline, topology),
                      host_memory_note=host_memory_note)
