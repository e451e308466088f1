"""The training step of a pipelined model: torch's schedule runs forward and backward over the
micro-batches; mpt scales the loss, divides the gradients once, and hands every rank the loss.

Gradients are divided exactly once: each micro-batch's loss by M x ``accumulate`` before its
backward (the schedule's own ``scale_grads`` stays off, so accumulation on top of it is not
divided twice), and the loss is scaled by the precision's loss scale there, where the schedule
calls the loss function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mpt.errors import UsageError
from mpt.pairs import Pair
from mpt.pipeline.config import schedule_class
from mpt.pipeline.split import Stage
from mpt.step import TrainStep

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from mpt.pipeline.stages import Stages

LossFn = Callable[[Any, Any], torch.Tensor]


class PipelineStep(TrainStep):
    """``TrainStep`` whose forward and backward are a pipeline schedule's: the model set up
    with an optimizer is cut into ``stages``, the models set up without one are placed whole
    on every rank, as without a pipeline."""

    def __init__(self, *, stages: Stages, **parts: Any) -> None:
        super().__init__(**parts)
        self.stages = stages
        self._schedules: dict[int, _PipelineSchedule] = {}
        self._loss_fn: LossFn | None = None
        self._losses: list[torch.Tensor] = []  # this call's micro-batch losses, unscaled
        self._shapes: dict[int, tuple[int, ...]] = {}  # the inputs' shape each pair first ran

    def place(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        if optimizer is None:  # trains nothing: whole on every rank
            return super().place(model, None)
        return self.backend.place(self.stages.cut(model, optimizer), optimizer)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
             ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if optimizer is None:  # rank 0's weights everywhere
            return super().wrap(model, None)
        assert isinstance(model, Stage)
        self.stages.setup(model, optimizer)
        return model, optimizer

    def clip(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
             norm_type: float) -> torch.Tensor:
        return self.stages.clip_grad_norm_(model, optimizer, max_norm, norm_type)

    def backward(self, loss: torch.Tensor, model: nn.Module | None) -> None:
        raise UsageError("rt.backward", "under --pipeline-stages", "the pipeline's schedule "
                         "runs forward and backward itself, micro-batch by micro-batch",
                         "call loss = rt.forward_backward(inputs, target, loss_fn), which "
                         "works without a pipeline too")

    def sync_for_next_micro_batch(self, pair: Pair) -> None:
        pass  # the schedule's model reduces on the last micro-batch of rt.forward_backward

    def _schedule(self, pair: Pair) -> _PipelineSchedule:
        """The pair's schedule, built on first use: one PipelineStage per chunk of this rank."""
        if id(pair) in self._schedules:
            return self._schedules[id(pair)]
        from torch.distributed.pipelining import PipelineStage

        backend, plan = self.backend, self.stages.plan
        indices = plan.chunks_of(self.stages.topology.stage)
        stages = [PipelineStage(backend.stage_module(chunk), stage_index=index,
                                num_stages=plan.chunks,
                                device=backend.device, group=self.stages.pp_group)
                  for index, chunk in zip(indices, pair.model.chunks,  # type: ignore[union-attr]
                                          strict=True)]
        kind = schedule_class(plan.schedule)
        schedule = kind(stages if plan.chunks_per_rank > 1 else stages[0],  # type: ignore[arg-type]
                        n_microbatches=plan.microbatches, loss_fn=self._scaled_loss,
                        scale_grads=False)
        self._schedules[id(pair)] = schedule
        return schedule

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        """What the schedule backpropagates for one micro-batch: the script's loss, divided for
        micro-batches and accumulation, times the loss scale. Nothing for an evaluation
        without loss (the schedule computes one all the same: see ``_run``)."""
        if self._loss_fn is None:
            return torch.zeros((), device=self.backend.device)
        loss = self._loss_fn(output, target)
        self._losses.append(loss.detach().float())
        divided = loss / (self.stages.plan.microbatches * self.accumulate)
        return self.backend.precision.scale_loss(divided)

    def _run(self, pair: Pair, inputs: Any, target: Any, loss_fn: LossFn | None,
             train: bool) -> Any:
        """One schedule call; returns the last stage's merged output there, else None."""
        place, plan = self.stages.topology, self.stages.plan
        first = plan.holder(0) == place.stage  # takes the inputs
        last = plan.holder(plan.chunks - 1) == place.stage  # computes the loss
        for name, value in (("inputs", inputs if first else None),
                            ("target", target if last else None)):
            if isinstance(value, torch.Tensor) and value.shape[0] % plan.microbatches:
                raise UsageError(name, f"a batch of {value.shape[0]}", "it does not split "
                                 f"into the {plan.microbatches} micro-batches of the pipeline",
                                 f"make the per-replica batch a multiple of "
                                 f"{plan.microbatches}, or pass another --microbatches")
        if isinstance(inputs, torch.Tensor):  # every rank is given them: all refuse alike
            shape = self._shapes.setdefault(id(pair), tuple(inputs.shape))
            if tuple(inputs.shape) != shape:
                raise UsageError("inputs", f"a batch of shape {tuple(inputs.shape)}", "torch's "
                                 "pipeline stages send the shapes of their first call, "
                                 f"{shape}, every call after it", "train and evaluate on "
                                 "batches of one shape (drop_last=True, equal lengths)")
        schedule = self._schedule(pair)
        self._loss_fn, self._losses = loss_fn, []
        args = (inputs,) if first else ()
        if train and not last:
            # Only the last stage scales a loss; a scaler that never scaled refuses to unscale,
            # so the other stages' scalers take up their (equal) scale here.
            self.backend.precision.scale_loss(torch.zeros((), device=self.backend.device))
        with self.backend.precision.autocast():
            if train:
                return schedule.step(*args, target=target if last else None)
            # A schedule with a loss function computes it on the last stage, in eval too: without
            # a loss asked for, the inputs stand in for the target (the same micro-batches).
            with torch.no_grad():
                return schedule.eval(*args, target=(target if loss_fn else inputs)
                                     if last else None)

    def _from_last_stage(self, value: torch.Tensor | None) -> torch.Tensor:
        """``value`` of the last stage, on every stage of this replica."""
        box = [value]
        plan = self.stages.plan
        dist.broadcast_object_list(box, group_src=plan.holder(plan.chunks - 1),
                                   group=self.stages.pp_group)
        assert box[0] is not None
        return box[0]

    def _batch_loss(self) -> torch.Tensor | None:
        """The mean of this call's micro-batch losses (the last M: on its first call torch's
        stage also runs the loss once to learn the shapes)."""
        losses = self._losses[-self.stages.plan.microbatches:]
        return torch.stack(losses).mean() if losses else None

    def forward_backward(self, model: nn.Module | None, inputs: Any, target: Any,
                         loss_fn: LossFn) -> torch.Tensor:
        self.mark("backward")
        pair = self.pair_of(model, "forward_backward")
        if not isinstance(pair.model, Stage):
            raise UsageError("model", pair.name, "it was set up without an optimizer, whole on "
                             "every rank, and a pipeline trains only the model it cuts",
                             "call rt.forward_backward without model=, or with the pipelined "
                             "model")
        self._run(pair, inputs, target, loss_fn, train=True)
        if not self.accumulating(pair):  # the step's last micro-batch: replicas agree now
            self.stages.reduce_gradients(pair.model)
        loss = self._from_last_stage(self._batch_loss())
        self.mark("script")
        self.monitor.on_backward(loss)
        self.micro_step += 1
        return loss

    def evaluate(self, model: nn.Module | None, inputs: Any, target: Any = None,
                 loss_fn: LossFn | None = None) -> Any:
        pair = self.pair_of(model, "evaluate")
        if not isinstance(pair.model, Stage):  # set up without an optimizer: whole here
            return super().evaluate(model, inputs, target, loss_fn)
        output = self._run(pair, inputs, target, loss_fn, train=False)
        if loss_fn is not None:
            return self._from_last_stage(self._batch_loss())
        return self._from_last_stage(None if output is None else output.detach().cpu())
