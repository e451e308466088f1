"""A data-parallel backend with its model cut into pipeline stages over ranks.

The world is a (pipeline, data) mesh of P x D ranks, pipeline outermost: rank = stage x D +
replica, so one replica's stages span nodes (they send only activations) while the replicas of
a stage, which average gradients, share a node where they can. This class cuts the model, keeps
this rank's chunks, runs the schedule (``PipelineStep``), averages each stage's gradients over
its replicas once per optimizer step, and makes what the rest of mpt sees look like one model:
state dicts under the whole model's parameter names, gradient norms over every stage, one
overflow verdict for all. The inner backend (ddp or fsdp) joins the processes, keeps each
stage's replicas equal (``Backend.setup_stage``/``reduce_stage``: ddp replicates the stage and
averages after the schedule, fsdp shards it over the replicas), steps the optimizer in the
run's precision and offers the collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

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
from mpt.pipeline.step import PipelineStep

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class PipelineBackend(Backend):
    """``inner`` (a data-parallel backend) over each stage's replicas, the stages in a pipe."""

    launcher = "elastic"

    def __init__(self, inner: Backend, plan: PipelinePlan, topology: Topology) -> None:
        self.inner = inner
        self.plan = plan
        self.name = inner.name  # type: ignore[misc]  # the run's backend, as it was asked for
        self.option_values = inner.option_values
        self.world, self.device, self.precision = inner.world, inner.device, inner.precision
        self.accumulate, self.timeout, self.comm = inner.accumulate, inner.timeout, inner.comm
        self.topology = topology
        """This rank's stage and replica."""
        self.layout = topology.plan
        """The job's parallel layout, as every backend holds it."""
        self.pp_group: dist.ProcessGroup | None = None
        """The ranks of this rank's replica, one per stage (set by ``init_process_group``)."""
        self.dp_mesh: DeviceMesh | None = None
        """The replicas of this rank's stage (set by ``init_process_group``)."""
        self._ties: list[tuple[str, Any]] = []  # shared across stages: (name here, group)
        self._aliases: dict[str, str] = {}  # a shared parameter's name here -> its owner's
        self._not_owned: set[str] = set()  # names here of shared parameters another stage owns
        self._placed = False  # the model cut into stages was placed

    # -- life cycle ---------------------------------------------------------------------------
    def init_process_group(self) -> None:
        self.inner.init_process_group()
        self.pp_group, self.dp_mesh = self.inner.mesh.get_group("pp"), self.inner.data_mesh

    def place(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> nn.Module:
        """Keep this rank's chunks of ``model`` (the others are dropped) and place them; a
        model set up without an optimizer (a frozen teacher) is placed whole, by the inner
        backend, on every rank."""
        if optimizer is None:
            return self.inner.place(model)
        if self._placed:
            raise UsageError("model", type(model).__name__, "a pipeline cuts one model with "
                             "its optimizer over the ranks, and one is set up already",
                             "set up the others without an optimizer (frozen: placed whole on "
                             "every rank), or drop --pipeline-stages")
        if len([p for p in model.parameters() if p.requires_grad]) == 0:
            raise UsageError("model", type(model).__name__, "a pipeline trains the model it "
                             "cuts, and this one has no parameter that requires a gradient",
                             "set it up without an optimizer")
        self._placed = True
        meta = on_meta(model)
        if meta:
            check_materialisable(model)
        # Checked on the whole model, whose names the refusals give; each stage keeps its part.
        split = tensor_plan(model, self.layout.tp) if self.layout.tp > 1 else None
        chunks = stage_blocks(model, self.plan.chunks, self.plan.split)
        self._tie(chunks)
        stage = Stage([chunks[chunk] for chunk in self.plan.chunks_of(self.topology.stage)],
                      tensor_plan=split)
        if meta:
            self._materialise(model, stage, optimizer)
        return self.inner.place(stage, optimizer)

    def _materialise(self, model: nn.Module, stage: Stage,
                     optimizer: torch.optim.Optimizer) -> None:
        """Give a model built on the meta device the weights a CPU build would have drawn
        (``mpt.backends.meta``), keeping only this rank's stage: another stage's module goes
        back to the meta device as soon as it has drawn its numbers (every rank draws them
        all, in order, to reach its own). ``optimizer`` then holds the stage's new ones."""
        kept = {id(module) for module in stage.modules()}
        meta_params = dict(stage.named_parameters())
        with rank0_random_state(self.inner):
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
        for held in holders.values():
            stages = sorted({stage for stage, _ in held})
            if len(stages) < 2:
                continue
            owner_name = min(held)[1]
            mine = [name for stage, name in held if stage == self.topology.stage]
            for ranks in self.layout.groups("pp"):  # one per replica and tensor-parallel rank
                group = dist.new_group([ranks[stage] for stage in stages])
                if self.world.rank in ranks and mine:
                    self._ties.append((mine[0], group))
            for name in mine:
                if name != owner_name:
                    self._aliases[name] = owner_name
                    if self.topology.stage != stages[0]:
                        self._not_owned.add(name)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if optimizer is None:  # placed whole: rank 0's weights everywhere
            return self.inner.setup(model, None)
        assert isinstance(model, Stage)
        own = {id(p) for p in model.parameters()}
        for group in optimizer.param_groups:  # this rank steps its own stage's parameters
            group["params"] = [p for p in group["params"] if id(p) in own]
        assert self.dp_mesh is not None
        self.inner.setup_stage(model, model.chunks, optimizer, self.dp_mesh)
        return model, optimizer

    def average_gradients(self, model: nn.Module) -> None:
        """Sum the gradients of parameters shared across stages, then average this stage's
        gradients over its replicas (the inner backend's ``reduce_stage``). Collective."""
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, group in self._ties:
            grad = params[name].grad
            if grad is not None:  # under fsdp: this replica's shard, the same on each stage
                dist.all_reduce(local_part(grad), group=group)
        assert self.dp_mesh is not None
        self.inner.reduce_stage(model, self.dp_mesh)

    def make_step(self, **parts: Any) -> PipelineStep:
        return PipelineStep(backend=self, **parts)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def shutdown(self) -> None:
        self.inner.shutdown()

    # -- the step -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: nn.Module | None = None) -> None:
        raise UsageError("rt.backward", "under --pipeline-stages", "the pipeline's schedule "
                         "runs forward and backward itself, micro-batch by micro-batch",
                         "call loss = rt.forward_backward(inputs, target, loss_fn), which "
                         "works without a pipeline too")

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        pass  # the schedule reduces on the last micro-batch of each rt.forward_backward

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm over every stage's gradients (replicas of a stage hold the same ones, or
        shards of them: a DTensor norm, whole once reduced over them)."""
        self.precision.unscale_(optimizer)  # after one overflow verdict for all stages
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None]
        names = {param: name for name, param in model.named_parameters()}
        counted = [p.grad for p in params if names[p] not in self._not_owned]  # ties once
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

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.zero_grad(optimizer)

    def update_loss_scale(self) -> None:
        self.inner.update_loss_scale()

    # -- state: the whole model's names, whichever stage holds them ---------------------------
    def _gather(self, local: dict[str, Any]) -> list[dict[str, Any]]:
        """Every stage's ``local`` (of this rank's replica), in stage order."""
        found: list[Any] = [None] * self.plan.stages
        dist.all_gather_object(found, local, group=self.pp_group)
        return found

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        local = self.inner.model_state_dict(model)  # this stage's, whole
        merged: dict[str, torch.Tensor] = {}
        for part in self._gather({k: v.detach().cpu() for k, v in local.items()}):
            merged.update(part)
        return merged

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """This stage's keys of ``state`` (the whole model's, or a sharded checkpoint's read in
        part: the other stages' left unread) into the stage."""
        own = model.state_dict().keys()
        missing = sorted(set(own) - set(state))
        if missing:
            raise UsageError("checkpoint", ", ".join(missing[:3]), "it has no weights for "
                             "these parameters of this stage", "load it into the model it was "
                             "saved from")
        self.inner.load_model_state_dict(model, {k: state[k] for k in own})

    # -- state for sharded checkpoints: this rank's stage, as the inner backend holds it ------
    shards_state: ClassVar[bool] = True
    """Each rank holds its stage only (under fsdp, its shards of it): a sharded checkpoint
    takes every stage's pieces from the ranks holding them and gathers nothing."""

    def local_model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The inner backend's state of this rank's stage: its ``DTensor`` shards under fsdp,
        its whole tensors under ddp (which the stage's replicas hold alike), under the whole
        model's names (a ``Stage`` keeps them)."""
        return self.inner.local_model_state_dict(model)

    def local_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                   *, create: bool = False) -> dict[str, Any]:
        """The inner backend's optimizer state of this rank's stage, named as
        ``optimizer_state_dict`` names it: a parameter that stages share by its owner's name,
        on every stage that holds it."""
        local = self.inner.local_optimizer_state_dict(model, optimizer, create=create)
        return _renamed(local, self._aliases)

    def parameter_names(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """As one process names them: a shared parameter by its owner's name on every stage."""
        return [self._aliases.get(name, name)
                for name in super().parameter_names(model, optimizer)]

    def optimizer_state_dict(self, model: nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        local = _renamed(self.inner.optimizer_state_dict(model, optimizer), self._aliases)
        parts = self._gather(local)
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        for part in parts:
            merged["state"].update(part["state"])
        for index, group in enumerate(parts[0]["param_groups"]):
            names = [name for part in parts for name in part["param_groups"][index]["params"]]
            merged["param_groups"].append({**group, "params": list(dict.fromkeys(names))})
        return merged

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """The state of this stage's parameters in ``state`` (the whole model's), the others'
        dropped."""
        own = set(self.parameter_names(model, optimizer))
        mine = {"state": {k: v for k, v in state["state"].items() if k in own},
                "param_groups": [{**group, "params": [n for n in group["params"] if n in own]}
                                 for group in state["param_groups"]]}
        owners = {owner: name for name, owner in self._aliases.items()}
        self.inner.load_optimizer_state_dict(model, optimizer, _renamed(mine, owners))

    # -- collectives over the whole world: the inner backend's --------------------------------
    def broadcast_tensor_(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.inner.broadcast_tensor_(tensor, src)

    def barrier(self) -> None:
        self.inner.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self.inner.all_reduce(tensor, op)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.inner.broadcast_object(obj, src)

    def sum_async(self, tensor: torch.Tensor) -> Callable[[], None]:
        return self.inner.sum_async(tensor)


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """An optimizer state by parameter name (``mpt.state.named``), its names mapped by
    ``names`` (those it lacks kept)."""
    return {"state": {names.get(k, k): v for k, v in state["state"].items()},
            "param_groups": [{**group, "params": [names.get(n, n) for n in group["params"]]}
                             for group in state["param_groups"]]}
