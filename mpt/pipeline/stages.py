"""The pipeline axis: one model cut into stages over ranks, each stage data-parallel.

The world is a (pipeline, data) mesh of P x D ranks, pipeline outermost: rank = stage x D +
replica, so one replica's stages span nodes (they send only activations) while the replicas of
a stage, which average gradients, share a node where they can. ``Stages`` cuts the model, keeps
this rank's chunks and does for the whole model what one process does once: sum the gradients
of parameters that stages share, and take the clip norm over every stage. The data-parallel
backend (ddp or fsdp) stays what it is without a pipeline: it joins the processes, keeps each
stage's replicas equal (``Backend.setup_stage``/``reduce_stage``: ddp replicates the stage and
averages after the schedule, fsdp shards it over the replicas), steps the optimizer in the
run's precision and offers the collectives. ``PipelineStep`` runs the schedule and
``StagedState`` merges the stages' state for checkpoints.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mpt.backends.base import Backend, local_part, on_meta, whole
from mpt.backends.meta import check_materialisable, materialise, rank0_random_state
from mpt.errors import UsageError
from mpt.parallel import Topology
from mpt.parallel.tensor import tensor_plan
from mpt.pipeline.config import PipelinePlan
from mpt.pipeline.split import Stage, stage_blocks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class Stages:
    """This rank's stage of the one model a pipeline trains, and the groups between stages.
    ``backend``: the data-parallel backend over each stage's replicas."""

    def __init__(self, backend: Backend, plan: PipelinePlan, topology: Topology) -> None:
        self.backend = backend
        self.plan = plan
        self.topology = topology
        """This rank's stage and replica."""
        self.aliases: dict[str, str] = {}
        """A parameter that stages share: its name here -> its owner's (the first stage's)."""
        self.not_owned: set[str] = set()
        """Names here of shared parameters another stage owns (counted once, there)."""
        self._ties: list[tuple[str, Any]] = []  # shared across stages: (name here, group)
        self._cut = False  # the model was cut into stages

    @functools.cached_property
    def pp_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's replica, one per stage (after ``init_process_group``)."""
        return self.backend.mesh.get_group("pp")

    @functools.cached_property
    def dp_mesh(self) -> DeviceMesh:
        """The replicas of this rank's stage."""
        return self.backend.data_mesh

    def cut(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Stage:
        """This rank's chunks of ``model`` (the others are dropped), materialised where
        ``model`` is on the meta device; ``optimizer`` follows the parameters that replaces."""
        if self._cut:
            raise UsageError("model", type(model).__name__, "a pipeline cuts one model with "
                             "its optimizer over the ranks, and one is set up already",
                             "set up the others without an optimizer (frozen: placed whole on "
                             "every rank), or drop --pipeline-stages")
        if len([p for p in model.parameters() if p.requires_grad]) == 0:
            raise UsageError("model", type(model).__name__, "a pipeline trains the model it "
                             "cuts, and this one has no parameter that requires a gradient",
                             "set it up without an optimizer")
        self._cut = True
        meta = on_meta(model)
        if meta:
            check_materialisable(model)
        # Checked on the whole model, whose names the refusals give; each stage keeps its part.
        layout = self.topology.plan
        split = tensor_plan(model, layout.tp) if layout.tp > 1 else None
        chunks = stage_blocks(model, self.plan.chunks, self.plan.split)
        self._tie(chunks)
        stage = Stage([chunks[chunk] for chunk in self.plan.chunks_of(self.topology.stage)],
                      tensor_plan=split)
        if meta:
            self._materialise(model, stage, optimizer)
        return stage

    def _materialise(self, model: nn.Module, stage: Stage,
                     optimizer: torch.optim.Optimizer) -> None:
        """Give a model built on the meta device the weights a CPU build would have drawn
        (``mpt.backends.meta``), keeping only this rank's stage: another stage's module goes
        back to the meta device as soon as it has drawn its numbers (every rank draws them
        all, in order, to reach its own). ``optimizer`` then holds the stage's new ones."""
        kept = {id(module) for module in stage.modules()}
        meta_params = dict(stage.named_parameters())
        with rank0_random_state(self.backend):
            for module in model.modules():
                if on_meta(module, recurse=False):
                    materialise(module, "cpu")
                    if id(module) not in kept:
                        module.to_empty(device="meta", recurse=False)
        params = dict(stage.named_parameters())
        materialised = {id(meta_params[name]): params[name] for name in meta_params}
        for group in optimizer.param_groups:
            group["params"] = [materialised.get(id(p), p) for p in group["params"]]

    def _tie(self, chunks: list[list[tuple[str, nn.Module]]]) -> None:
        """Find the parameters that blocks on several stages share (a GPT's token embedding and
        output layer), and a group of the ranks holding each, per replica: their gradients are
        summed there, as one process sums both uses. Collective: every rank makes every group.
        The first stage holding one owns it: its name keys the optimizer state, and its
        gradient alone counts in the clip norm."""
        holders: dict[int, list[tuple[int, str, nn.Parameter]]] = {}
        for index, blocks in enumerate(chunks):
            for name, block in blocks:
                for local, param in block.named_parameters(prefix=name, remove_duplicate=False):
                    holders.setdefault(id(param), []).append((self.plan.holder(index), local))
        here = self.topology.stage
        for held in holders.values():
            stages = sorted({stage for stage, _ in held})
            if len(stages) < 2:
                continue
            owner_name = min(held)[1]
            mine = [name for stage, name in held if stage == here]
            for ranks in self.topology.plan.groups("pp"):  # one per replica and tp rank
                group = dist.new_group([ranks[stage] for stage in stages])
                if self.topology.rank in ranks and mine:
                    self._ties.append((mine[0], group))
            for name in mine:
                if name != owner_name:
                    self.aliases[name] = owner_name
                    if here != stages[0]:
                        self.not_owned.add(name)

    def setup(self, stage: Stage, optimizer: torch.optim.Optimizer) -> None:
        """Leave in ``optimizer`` this stage's parameters only, and have the backend keep the
        stage's replicas equal."""
        own = {id(p) for p in stage.parameters()}
        for group in optimizer.param_groups:  # this rank steps its own stage's parameters
            group["params"] = [p for p in group["params"] if id(p) in own]
        self.backend.setup_stage(stage, stage.chunks, optimizer, self.dp_mesh)

    def reduce_gradients(self, stage: nn.Module) -> None:
        """Sum the gradients of parameters shared across stages, then average this stage's
        gradients over its replicas (the backend's ``reduce_stage``). Collective."""
        params = dict(stage.named_parameters(remove_duplicate=False))
        for name, group in self._ties:
            grad = params[name].grad
            if grad is not None:  # under fsdp: this replica's shard, the same on each stage
                dist.all_reduce(local_part(grad), group=group)
        self.backend.reduce_stage(stage, self.dp_mesh)

    def clip_grad_norm_(self, stage: nn.Module, optimizer: torch.optim.Optimizer,
                        max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip at the norm over every stage's gradients (replicas of a stage hold the same
        ones, or shards of them: a DTensor norm, whole once reduced over them)."""
        self.backend.precision.unscale_(optimizer)  # after one overflow verdict for all
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None]
        names = {param: name for name, param in stage.named_parameters()}
        counted = [p.grad for p in params if names[p] not in self.not_owned]  # ties once
        local = whole(torch.nn.utils.get_total_norm(counted, norm_type).float())
        if norm_type == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.pp_group)
            total = local
        else:
            power = local.pow(norm_type)
            dist.all_reduce(power, group=self.pp_group)
            total = power.pow(1.0 / norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def gather(self, local: Any) -> list[Any]:
        """Every stage's ``local`` (of this rank's replica), in stage order. Collective."""
        found: list[Any] = [None] * self.plan.stages
        dist.all_gather_object(found, local, group=self.pp_group)
        return found
