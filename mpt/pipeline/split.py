"""Cut a model into pipeline stages: consecutive blocks, balanced by parameter count or cut where
the user names.

The convention a model follows to be split: it is an ``nn.Sequential``, or it has a method
``pipeline_blocks()`` returning its submodules in the order its forward runs them, such that
``forward(x)`` equals feeding ``x`` through the blocks one after the other (each block takes the
previous block's output as its only argument). A stage runs its consecutive blocks the same way.

Parameter names never change: a stage keeps its blocks under the names the whole model gives
them, so its state dict is a slice of the whole model's and checkpoints move between any number
of stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from mpt.errors import UsageError
from mpt.parallel.tensor import restricted

SPLIT_FLAG = "--pipeline-split"


def ordered_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks in forward order, each with its name in the model; a UsageError for a
    model that follows neither convention."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    blocks = getattr(model, "pipeline_blocks", None)
    if not callable(blocks):
        raise UsageError("model", type(model).__name__, "it can be split into pipeline stages "
                         "neither as an nn.Sequential nor by a pipeline_blocks() method",
                         "build it as an nn.Sequential, or give it a pipeline_blocks() method "
                         "returning its submodules in forward order (docs/pipeline.md)")
    names = {id(module): name for name, module in model.named_modules() if name}
    found = []
    for block in blocks():
        if id(block) not in names:
            raise UsageError("pipeline_blocks()", type(block).__name__, "it returned a module "
                             "that is not a submodule of the model", "return the model's own "
                             "submodules, in forward order")
        found.append((names[id(block)], block))
    return found


def balanced_cuts(sizes: Sequence[int], stages: int) -> list[int]:
    """Indices where stages 1..P-1 start, splitting ``sizes`` (parameters per block) into
    ``stages`` consecutive runs whose largest total is as small as it can be."""
    if len(sizes) < stages:
        raise UsageError("--pipeline-stages", stages, f"the model has {len(sizes)} blocks to "
                         "split", f"pass --pipeline-stages {len(sizes)} or fewer")

    def runs(limit: int) -> list[int] | None:
        cuts, total = [], 0
        for index, size in enumerate(sizes):
            if total + size > limit and total > 0:
                cuts.append(index)
                total = 0
            total += size
        return cuts if len(cuts) < stages else None

    low, high = max(sizes), sum(sizes)
    while low < high:  # the smallest per-stage limit that needs no more than P runs
        middle = (low + high) // 2
        if runs(middle) is None:
            low = middle + 1
        else:
            high = middle
    cuts = runs(low) or []
    # Fewer runs than stages (tiny blocks): cut the largest runs further, one block each.
    while len(cuts) < stages - 1:
        bounds = [0, *cuts, len(sizes)]
        spans = [(sum(sizes[a:b]), a, b) for a, b in pairwise(bounds) if b - a > 1]
        _, start, end = max(spans)
        cuts = sorted({*cuts, start + (end - start) // 2})
    return cuts


def named_cuts(names: Sequence[str], split: Sequence[str], stages: int) -> list[int]:
    """Indices of the blocks named in ``split`` (where stages 1..P-1 start)."""
    if len(split) != stages - 1:
        raise UsageError(SPLIT_FLAG, ",".join(split), f"{stages} stages start at "
                         f"{stages - 1} blocks after the first", f"name {stages - 1} of: "
                         f"{', '.join(names[1:])}")
    cuts = []
    for name in split:
        if name not in names[1:]:
            raise UsageError(SPLIT_FLAG, name, "no block after the first has that name",
                             f"name blocks among: {', '.join(names[1:])}")
        cuts.append(names.index(name))
    if cuts != sorted(set(cuts)):
        raise UsageError(SPLIT_FLAG, ",".join(split), "the stages' first blocks must be "
                         "named in forward order, each once", f"order them as: "
                         f"{', '.join(n for n in names if n in split)}")
    return cuts


def stage_blocks(model: nn.Module, stages: int, split: Sequence[str] = ()
                 ) -> list[list[tuple[str, nn.Module]]]:
    """Every stage's blocks, in order: cut at the named blocks, or balanced by parameter count."""
    blocks = ordered_blocks(model)
    names = [name for name, _ in blocks]
    if split:
        cuts = named_cuts(names, split, stages)
    else:
        cuts = balanced_cuts([sum(p.numel() for p in block.parameters())
                              for _, block in blocks], stages)
    bounds = [0, *cuts, len(blocks)]
    return [blocks[a:b] for a, b in pairwise(bounds)]


class Chunk(nn.Module):
    """Consecutive blocks of a model, run one after the other: what one pipeline stage runs."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Stage(nn.Module):
    """The chunks of a model one rank holds (one; two under a looped schedule), under the
    model's own names.

    The blocks are registered at their paths in the model (``blocks.3`` becomes the child
    ``blocks`` holding a child ``3``), so ``state_dict`` keys and parameter names are the whole
    model's. ``chunks`` runs them (not registered: the same blocks under other names).
    ``tensor_plan``: the model's ``tensor_parallel_plan()``, which the stage's own declares for
    the modules it holds.
    """

    def __init__(self, chunks: Sequence[Sequence[tuple[str, nn.Module]]], *,
                 tensor_plan: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        for name, block in (item for chunk in chunks for item in chunk):
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, block)
        self.chunks = [Chunk([block for _, block in chunk]) for chunk in chunks]
        """What each of this rank's pipeline stages runs."""
        self._tensor_plan = restricted(tensor_plan or {}, self)

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """The model's tensor-parallel plan, for the modules this stage holds."""
        return self._tensor_plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise UsageError("model(...)", "a pipeline stage", "under --pipeline-stages the "
                         "schedule runs the stages' forwards", "call rt.forward_backward(inputs, "
                         "target, loss_fn) or rt.evaluate(inputs)")
