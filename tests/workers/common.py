"""Model and data shared by the distributed workers and the single-process references."""

from __future__ import annotations

import torch
from torch import nn

FEATURES = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def global_batches(steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``size`` rows; ranks and micro-batches take slices of them."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, FEATURES, generator=g), torch.randn(size, 1, generator=g))
            for _ in range(steps)]


def reference_params(steps: int, size: int) -> list[torch.Tensor]:
    """Plain single-process torch on the whole global batches: what every rank must reach."""
    model = make_model()
    optimizer = make_optimizer(model)
    for x, y in global_batches(steps, size):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]
