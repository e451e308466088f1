"""Tensor parallelism: a model's layers split over the ``tp`` axis with torch's DTensor styles.

A model declares how (``tensor_parallel_plan()``, in the spirit of ``pipeline_blocks()``): the
names of its modules and the style of each, Megatron's split of a transformer block being

    def tensor_parallel_plan(self):
        return {f"blocks.{i}.{name}": style for i in range(len(self.blocks))
                for name, style in (("qkv", Split("colwise", unit=3 * head_dim, what="heads")),
                                    ("proj", "rowwise"), ("mlp.0", "colwise"),
                                    ("mlp.2", "rowwise"))}

``colwise`` splits a Linear's output features (its input whole on every rank, its output this
rank's columns), ``rowwise`` its input features (the partial outputs summed over the ranks),
``sequence`` a norm over the sequence dimension; a torch ``ParallelStyle`` passes as it is.
Modules the plan does not name stay whole on every rank (embeddings, norms), their gradients
equal on every tp rank, since each rank's copy sees the same inputs and gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from mpt.errors import UsageError
from mpt.parallel.plan import divisors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

Style = Literal["colwise", "rowwise", "sequence"]
STYLES: tuple[Style, ...] = ("colwise", "rowwise", "sequence")
SPLIT_DIM = {"colwise": 0, "rowwise": 1}
"""The dimension of a Linear's weight each style splits (its out, its in features)."""


@dataclass(frozen=True, slots=True)
class Split:
    """A style whose split must keep groups of ``unit`` features together (an attention
    head's rows of a fused projection): the features must be ``unit`` x a multiple of T."""

    style: Style
    """``colwise`` or ``rowwise``."""
    unit: int = 1
    """Features that stay on one rank."""
    what: str = "features"
    """What a unit is, for the refusal (``heads``)."""


PlanEntry = str | Split | Any
"""A value of ``tensor_parallel_plan()``: a style's name, a ``Split``, or a ParallelStyle."""


def tensor_plan(model: nn.Module, size: int, *, flag: str = "--tensor-parallel"
                ) -> dict[str, PlanEntry]:
    """``model``'s plan, checked against the model and a tp size of ``size``: every module
    named exists, every style is known, and ``size`` divides every split. A UsageError names
    the flag, the module and what works."""
    declare = getattr(model, "tensor_parallel_plan", None)
    if declare is None:
        raise UsageError(flag, size, f"{type(model).__name__} declares no tensor-parallel "
                         "plan", "add a method tensor_parallel_plan() returning {module name: "
                         "'colwise' | 'rowwise' | 'sequence'} (see docs/parallel.md), or pass "
                         f"{flag} 1")
    plan: Mapping[str, PlanEntry] = declare()
    modules = dict(model.named_modules())
    for name, entry in plan.items():
        if name not in modules:
            known = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise UsageError("tensor_parallel_plan()", name, f"{type(model).__name__} has no "
                             "module of that name", f"name one of its Linear modules: "
                             f"{', '.join(known[:8])}{', ...' if len(known) > 8 else ''}")
        _check_split(name, modules[name], entry, size, flag)
    return dict(plan)


def _check_split(name: str, module: nn.Module, entry: PlanEntry, size: int, flag: str) -> None:
    """Refuse a split that ``size`` does not divide (in whole ``unit``s), naming the module."""
    style = entry.style if isinstance(entry, Split) else entry
    if not isinstance(style, str):
        return  # a ParallelStyle of torch's: it checks its own layouts
    if style not in STYLES:
        raise UsageError("tensor_parallel_plan()", f"{name}: {style}", "it is no style mpt "
                         "knows", f"use one of {', '.join(STYLES)}, or a torch ParallelStyle")
    if style not in SPLIT_DIM:
        return
    if not isinstance(module, nn.Linear):
        raise UsageError("tensor_parallel_plan()", f"{name}: {style}", f"it is a "
                         f"{type(module).__name__}, and {style} splits a Linear's features",
                         "name a Linear module, or pass a torch ParallelStyle for it")
    unit = entry.unit if isinstance(entry, Split) else 1
    what = entry.what if isinstance(entry, Split) else "features"
    features = module.weight.shape[SPLIT_DIM[style]]
    units = features // unit
    if features % unit or units % size:
        fits = divisors(units)
        raise UsageError(flag, size, f"{name} ({style}) has {units} {what}, which {size} "
                         "ranks do not split evenly", f"pass {flag} one of "
                         f"{', '.join(map(str, fits))}")


def _style(entry: PlanEntry) -> ParallelStyle:
    """torch's ParallelStyle for a plan entry."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    style = entry.style if isinstance(entry, Split) else entry
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "sequence":
        return SequenceParallel()
    return style


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                plan: Mapping[str, PlanEntry]) -> None:
    """Split ``model``'s planned modules over ``mesh`` (the tp axis), in place, and point
    ``optimizer`` at the DTensor parameters that replace theirs. The weights of every other
    module become replicated DTensors on the same mesh: one kind of tensor for the optimizer,
    the loss scaler and the clip (torch's take DTensors of one mesh, not a mix with plain
    tensors). All come from the group's first rank (``distribute_tensor`` scatters or
    broadcasts them from there), so that every tp rank starts from one model. Collective over
    ``mesh``."""
    from torch.distributed.tensor.parallel import parallelize_module

    name_of = {param: name for name, param in model.named_parameters()}
    parallelize_module(model, mesh, {name: _style(entry) for name, entry in plan.items()})
    _replicate_rest(model, mesh, plan)
    split = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [split[name_of[p]] if p in name_of else p for p in group["params"]]


def _replicate_rest(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, PlanEntry]) -> None:
    """Make the weights and buffers of the modules ``plan`` leaves whole replicated DTensors,
    each module taking plain tensors in and giving plain tensors out as before (its forward
    runs on DTensors: the same arithmetic, no communication). A weight two modules share (a
    GPT's tied embedding and output layer) stays one parameter."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    made: dict[int, nn.Parameter] = {}

    def replicate(_name: str, module: nn.Module, _mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            if id(param) not in made:
                made[id(param)] = nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()]),
                                               requires_grad=param.requires_grad)
            module.register_parameter(key, made[id(param)])
        for key, buffer in list(module.named_buffers(recurse=False)):
            if not isinstance(buffer, DTensor):
                module.register_buffer(key, distribute_tensor(buffer, mesh, [Replicate()]))

    def inputs(_module: nn.Module, args: tuple[Any, ...], device_mesh: DeviceMesh) -> Any:
        return tuple(DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                     for a in args)

    def outputs(_module: nn.Module, output: Any, _mesh: DeviceMesh) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    split = [name for name in plan]
    for name, module in model.named_modules():
        if any(name == s or name.startswith(f"{s}.") for s in split):
            continue  # its style placed it
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if own and not all(isinstance(t, DTensor) for t in own):
            distribute_module(module, mesh, replicate, input_fn=inputs, output_fn=outputs)


def restricted(plan: Mapping[str, PlanEntry], module: nn.Module) -> dict[str, PlanEntry]:
    """The entries of ``plan`` that name modules of ``module`` (a pipeline stage keeps the
    whole model's names)."""
    names = {name for name, _ in module.named_modules()}
    return {name: entry for name, entry in plan.items() if name in names}
