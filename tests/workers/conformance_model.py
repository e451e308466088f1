"""The conformance job's model, data and optimizer, and the same loop in plain torch (no mpt).

One small fixed job that every backend x precision cell of the conformance grid trains: a conv
net with batch norm on seeded synthetic 3x8x8 images of 4 classes, SGD with momentum, ``STEPS``
optimizer steps of ``GLOBAL_BATCH`` samples (split over ranks and micro-batches).
``conformance_job.py`` trains it through mpt; ``plain_run`` trains it here without mpt,
replaying the exact micro-batches a run saw, for two purposes: the reference itself is checked
against it in fp32, and its deviation in each mixed-precision recipe from its own fp32 run is
what a mixed cell's tolerance is scaled by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import Dataset

STEPS = 10
"""Optimizer steps of one run."""
GLOBAL_BATCH = 64
"""Samples per optimizer step over all ranks and micro-batches (the same in every cell)."""
CLASSES = 4
LR = 0.1
INIT_SCALE = 2.0**16
"""The dynamic loss scale's start, torch's and Apex's default."""


class Images(Dataset):
    """Seeded synthetic images: a class prototype plus noise, so the loss can go down.

    Items are ``(image, label, index)``: the index lets a run record which samples each rank's
    micro-batches held, which ``plain_run`` replays.
    """

    def __init__(self, size: int = STEPS * GLOBAL_BATCH) -> None:
        g = torch.Generator().manual_seed(1)
        prototypes = torch.randn(CLASSES, 3, 8, 8, generator=g)
        self.labels = torch.randint(0, CLASSES, (size,), generator=g)
        self.images = prototypes[self.labels] + torch.randn(size, 3, 8, 8, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.images[i], self.labels[i], i


class ConvNet(nn.Sequential):
    """The grid's model, with the plan `--tensor-parallel` splits it by: the head's classes
    over the tp ranks, gathered for the loss."""

    def tensor_parallel_plan(self) -> dict[str, object]:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel

        return {"8": ColwiseParallel(output_layouts=Replicate())}


def make_model() -> nn.Module:
    """Two conv + batch-norm blocks and a linear head; the same weights in every process."""
    torch.manual_seed(0)
    return ConvNet(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, CLASSES))


def initial_params() -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in make_model().named_parameters()}


def make_optimizer(params) -> torch.optim.Optimizer:
    """SGD with momentum: its update is linear in the gradient, so a gradient scaled wrongly
    (loss scale not undone, a sum instead of a mean, accumulation not divided) shows in the
    weights; Adam would normalise most of that away. It has no eps to vanish in fp16."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), labels)


# -- the same loop in plain torch -----------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """How plain torch trains in one precision; every field is a textbook torch idiom."""

    autocast: torch.dtype | None = None
    """``torch.autocast("cpu", dtype)`` around forward and loss."""
    cast: torch.dtype | None = None
    """The model's weights in this dtype (Apex O2/O3 style)."""
    keep_batchnorm_fp32: bool = True
    masters: bool = False
    """fp32 master copies of the cast weights, which the optimizer steps."""
    dynamic_scale: bool = False
    """Dynamic loss scaling with GradScaler's arithmetic: start 2^16, skip the step and halve
    on a non-finite gradient, double after 2000 clean steps (powers of two: exact unscaling)."""

    @property
    def low_dtype(self) -> torch.dtype:
        """The lower precision it computes in (float32 for fp32)."""
        return self.autocast or self.cast or torch.float32


RECIPES: dict[str, Recipe] = {
    "fp32": Recipe(),
    "autocast-bf16": Recipe(autocast=torch.bfloat16),
    "autocast-fp16": Recipe(autocast=torch.float16, dynamic_scale=True),
    "masters-fp16": Recipe(cast=torch.float16, masters=True, dynamic_scale=True),
    "masters-bf16": Recipe(cast=torch.bfloat16, masters=True),
    "pure-fp16": Recipe(cast=torch.float16, keep_batchnorm_fp32=False),
    "pure-bf16": Recipe(cast=torch.bfloat16, keep_batchnorm_fp32=False),
}

RECIPE_OF: dict[str, str] = {
    "fp32": "fp32", "O0": "fp32",
    "bf16-mixed": "autocast-bf16",
    "fp16-mixed": "autocast-fp16", "O1": "autocast-fp16",
    "O2": "masters-fp16", "O2-bf16": "masters-bf16",
    "O3": "pure-fp16", "O3-bf16": "pure-bf16",
}
"""mpt's precision names -> the plain-torch recipe with the same arithmetic."""


@dataclass
class PlainResult:
    losses: list[float]
    """Per optimizer step: the mean loss of its micro-batches over all ranks."""
    params: dict[str, torch.Tensor]
    """Final weights by parameter name, in fp32."""
    skipped: int
    """Steps skipped for non-finite gradients."""


def plain_run(recipe_name: str, schedule: Sequence[Sequence[Sequence[int]]], *,
              grad_factor: float = 1.0, lose_steps: Sequence[int] = ()) -> PlainResult:
    """Train in one process on the micro-batches ``schedule[step][k]`` (sample indices).

    A step's gradient is the mean of its micro-batches' gradients, which is what data-parallel
    training with accumulation computes (each rank divides by the accumulation steps, the
    allreduce averages over ranks); batch norm normalises each micro-batch on its own, as each
    rank does. ``grad_factor`` and ``lose_steps`` make it wrong on purpose (a gradient summed
    instead of averaged, updates that never happen), to show what the tolerances catch.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only waits (10x slower on a busy CPU)
    try:
        return _plain_run(RECIPES[recipe_name], schedule, grad_factor, lose_steps)
    finally:
        torch.set_num_threads(threads)


def _plain_run(recipe: Recipe, schedule: Sequence[Sequence[Sequence[int]]], grad_factor: float,
               lose_steps: Sequence[int]) -> PlainResult:
    data = Images()
    model = make_model()
    if recipe.cast is not None:
        for module in model.modules():
            if recipe.keep_batchnorm_fp32 and isinstance(module, _BatchNorm):
                continue
            module.to(recipe.cast)  # only this module's own tensors are left to cast
    model_params = list(model.parameters())
    masters = ([nn.Parameter(p.detach().float().clone()) if p.dtype != torch.float32 else p
                for p in model_params] if recipe.masters else model_params)
    optimizer = make_optimizer(masters)
    scale, clean = (INIT_SCALE if recipe.dynamic_scale else 1.0), 0
    losses, skipped = [], 0
    for micro_batches in schedule:
        step_losses = []
        for indices in micro_batches:
            x, y = data.images[list(indices)], data.labels[list(indices)]
            if recipe.cast is not None:
                x = x.to(recipe.cast)
            if recipe.autocast is not None:
                with torch.autocast("cpu", dtype=recipe.autocast):
                    loss = loss_fn(model(x), y)
            else:
                loss = loss_fn(model(x), y)
            (loss * (scale / len(micro_batches))).backward()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))
        grads = [None if p.grad is None else p.grad.float() * (grad_factor / scale)
                 for p in model_params]
        finite = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        if finite and len(losses) - 1 not in lose_steps:
            for master, grad in zip(masters, grads, strict=True):
                master.grad = grad.to(master.dtype)
            optimizer.step()
            if recipe.masters:
                with torch.no_grad():
                    for p, master in zip(model_params, masters, strict=True):
                        p.copy_(master)
        else:
            skipped += 1
        if recipe.dynamic_scale:
            scale, clean = (scale, clean + 1) if finite else (scale * 0.5, 0)
            if clean == 2000:
                scale, clean = scale * 2.0, 0
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    source = masters if recipe.masters else model_params
    names = [name for name, _ in model.named_parameters()]
    return PlainResult(losses=losses, skipped=skipped, params={
        name: p.detach().float().clone() for name, p in zip(names, source, strict=True)})
