"""A DCGAN-shaped loop (PyTorch's DCGAN example, on vectors) shared by the GAN workers and the
single-process reference: each optimizer zeroed before its own backward, the discriminator
stepped on a real and a fake loss, the generator through the discriminator."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

NOISE, DATA = 4, 6


def make_pair() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(NOISE, 16), nn.ReLU(), nn.Linear(16, DATA))
    discriminator = nn.Sequential(nn.Linear(DATA, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
    return generator, discriminator, opt_g, opt_d


def batches(steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(real samples, noise) per iteration; ranks take slices of each global batch."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(size, DATA, generator=g) * 0.5 + 1.0,
             torch.randn(size, NOISE, generator=g)) for _ in range(steps)]


def iteration(generator: nn.Module, discriminator: nn.Module, opt_g: torch.optim.Optimizer,
              opt_d: torch.optim.Optimizer, real: torch.Tensor, noise: torch.Tensor,
              backward: Callable[[torch.Tensor], None],
              step: Callable[[torch.optim.Optimizer], object]) -> tuple[float, float]:
    """One DCGAN iteration; ``backward``/``step`` are mpt's or plain torch's."""
    bce = nn.functional.binary_cross_entropy_with_logits
    opt_d.zero_grad()
    out = discriminator(real)
    err_d_real = bce(out, torch.ones_like(out))
    backward(err_d_real)
    fake = generator(noise)
    out = discriminator(fake.detach())
    err_d_fake = bce(out, torch.zeros_like(out))
    backward(err_d_fake)
    step(opt_d)
    opt_g.zero_grad()
    out = discriminator(fake)  # the discriminator's parameters get gradients too: dropped
    err_g = bce(out, torch.ones_like(out))
    backward(err_g)
    step(opt_g)
    return float(err_d_real + err_d_fake), float(err_g)


def reference(steps: int, size: int) -> dict[str, list[torch.Tensor]]:
    """Plain torch, one process, the whole global batches."""
    generator, discriminator, opt_g, opt_d = make_pair()
    for real, noise in batches(steps, size):
        iteration(generator, discriminator, opt_g, opt_d, real, noise,
                  lambda loss: loss.backward(), lambda opt: opt.step())
    return {"G": [p.detach().clone() for p in generator.parameters()],
            "D": [p.detach().clone() for p in discriminator.parameters()]}
