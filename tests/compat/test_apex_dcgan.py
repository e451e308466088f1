"""A script shaped like Apex's DCGAN example (``examples/dcgan/main_amp.py``: BatchNorm
networks, ``netD.zero_grad()``, ``amp.initialize([netD, netG], [optD, optG], num_losses=3)``,
one ``scale_loss`` per loss with its ``loss_id``) runs with only its import changed: at O0 it
trains bit for bit like the same loop without amp, at O1 and O2 it trains with finite losses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpt.compat.apex import amp  # was: from apex import amp


@pytest.fixture(autouse=True)
def fresh_amp(monkeypatch):
    monkeypatch.setattr(amp, "_state", None)


def networks():
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16),
                          nn.Tanh())
    net_d = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32),
                          nn.BatchNorm1d(32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    return net_d, net_g, opt_d, opt_g


def train(opt_level: str | None, iterations: int = 4) -> tuple[list[float], nn.Module, nn.Module,
                                                               torch.optim.Optimizer]:
    """The example's loop body; ``opt_level=None`` is the original without amp."""
    net_d, net_g, opt_d, opt_g = networks()
    if opt_level is not None:
        [net_d, net_g], [opt_d, opt_g] = amp.initialize(
            [net_d, net_g], [opt_d, opt_g], opt_level=opt_level, num_losses=3, verbosity=0)
    criterion = nn.BCEWithLogitsLoss()
    data = torch.Generator().manual_seed(1)

    def backward(loss: torch.Tensor, optimizer: torch.optim.Optimizer, loss_id: int) -> None:
        if opt_level is None:
            loss.backward()
            return
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
            scaled.backward()

    losses = []
    for _ in range(iterations):
        real = torch.randn(12, 16, generator=data) * 0.3 + 0.5
        noise = torch.randn(12, 8, generator=data)
        net_d.zero_grad()
        output = net_d(real)
        err_d_real = criterion(output, torch.ones_like(output))
        backward(err_d_real, opt_d, 0)
        fake = net_g(noise)
        output = net_d(fake.detach())
        err_d_fake = criterion(output, torch.zeros_like(output))
        backward(err_d_fake, opt_d, 1)
        opt_d.step()
        net_g.zero_grad()
        output = net_d(fake)
        err_g = criterion(output, torch.ones_like(output))
        backward(err_g, opt_g, 2)
        opt_g.step()
        losses += [float(err_d_real + err_d_fake), float(err_g)]
    return losses, net_d, net_g, opt_d


def test_o0_is_the_loop_without_amp_bit_for_bit():
    want, want_d, want_g, _ = train(None)
    got, got_d, got_g, _ = train("O0")
    assert got == want
    for mine, theirs in zip([*got_d.state_dict().values(), *got_g.state_dict().values()],
                            [*want_d.state_dict().values(), *want_g.state_dict().values()],
                            strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_mixed_opt_levels_train_the_dcgan_with_three_loss_scalers(opt_level):
    start_d, start_g = networks()[:2]
    losses, net_d, net_g, opt_d = train(opt_level, iterations=6)
    assert all(torch.isfinite(torch.tensor(losses)))
    for before, after in ((start_d, net_d), (start_g, net_g)):
        assert not torch.equal(before[0].weight, after[0].weight.float())
    assert sorted(amp.state_dict()) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    # the fp32 masters carry no gradient between steps (model.zero_grad() cannot reach them)
    if opt_level == "O2":
        masters = list(amp.master_params(opt_d))
        assert any(m.dtype == torch.float32 for m in masters)
        assert all(m.grad is None for m in masters if m.dtype == torch.float32
                   and m is not amp._state.precision.model_parameter(m))
