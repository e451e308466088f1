"""Apex's several losses: ``num_losses``/``loss_id``, two or three ``scale_loss`` blocks before
one ``step`` (with and without ``delay_unscale``), lists of models and optimizers as in Apex's
DCGAN example: the gradients are those of the unscaled losses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpt.compat.apex import amp
from mpt.errors import UsageError


@pytest.fixture(autouse=True)
def fresh_amp(monkeypatch):
    monkeypatch.setattr(amp, "_state", None)


def nets():
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
    d = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    return g, d


def losses(g, d, autocast: bool):
    """Three losses: D on real, D on detached fake (both D's), G through D."""
    torch.manual_seed(1)
    real, noise = torch.randn(5, 6), torch.randn(5, 4)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        fake = g(noise)
        d_real = d(real).float().pow(2).mean()
        d_fake = d(fake.detach()).float().abs().mean()
        g_loss = -d(fake).float().mean()
    return d_real, d_fake, g_loss


def grads(optimizer):
    return [p.grad.detach().float().clone() for grp in optimizer.param_groups
            for p in grp["params"]]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("delay", [False, True])
def test_several_scaled_losses_before_one_step_give_the_unscaled_gradients(opt_level, delay):
    g, d = nets()
    g_ref, d_ref = copy.deepcopy(g), copy.deepcopy(d)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    [g, d], [opt_d, opt_g] = amp.initialize([g, d], [opt_d, opt_g], opt_level=opt_level,
                                            num_losses=3, loss_scale=1024.0, verbosity=0)
    d_real, d_fake, g_loss = losses(g, d, opt_level == "O1")
    with amp.scale_loss(d_real, opt_d, loss_id=0, delay_unscale=delay) as scaled:
        scaled.backward()
    with amp.scale_loss(d_fake, opt_d, loss_id=1) as scaled:
        scaled.backward()
    got_d = grads(opt_d)  # before G's loss reaches D's parameters too (scaled, as in Apex)
    with amp.scale_loss(g_loss, opt_g, loss_id=2) as scaled:
        scaled.backward()

    # the reference: the same (cast) models, the same losses, no scaling
    amp_state = amp._state
    if opt_level == "O2":
        g_ref, d_ref = g_ref.half(), d_ref.half()
        g_ref.register_forward_pre_hook(lambda _m, a: tuple(t.half() for t in a))
        d_ref.register_forward_pre_hook(lambda _m, a: tuple(t.half() for t in a))
    r_real, r_fake, r_g = losses(g_ref, d_ref, opt_level == "O1")
    d_params = list(d_ref.parameters())
    real_grads = torch.autograd.grad(r_real, d_params)
    fake_grads = torch.autograd.grad(r_fake, d_params)
    # Each loss's gradients are unscaled into fp32 and summed there; a delayed unscale sums
    # them (scaled) in the gradients' own dtype first, as Apex did.
    d_grads = [(a + b).float() if delay else a.float() + b.float()
               for a, b in zip(real_grads, fake_grads, strict=True)]
    g_grads = [t.float() for t in torch.autograd.grad(r_g, list(g_ref.parameters()))]
    assert amp_state is amp._state and [s.scale for s in amp_state.scalers] == [1024.0] * 3
    for got, want in zip(got_d, d_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(grads(opt_g), g_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_an_overflow_in_one_loss_backs_off_that_scaler_and_skips_the_step():
    g, d = nets()
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    [g, d], opt_d = amp.initialize([g, d], opt_d, opt_level="O1", num_losses=2, verbosity=0)
    before = [p.detach().clone() for p in d.parameters()]
    d_real, d_fake, _ = losses(g, d, True)
    with amp.scale_loss(d_real, opt_d, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss(d_fake * float("inf"), opt_d, loss_id=1) as scaled:
        scaled.backward()
    opt_d.step()
    assert all(torch.equal(a, b) for a, b in zip(before, d.parameters(), strict=True))
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 1},
                                "loss_scaler1": {"loss_scale": 32768.0, "unskipped": 0}}
    opt_d.zero_grad()
    d_real, _, _ = losses(g, d, True)
    with amp.scale_loss(d_real, opt_d, loss_id=0) as scaled:
        scaled.backward()
    opt_d.step()  # the next step is taken again
    assert not all(torch.equal(a, b) for a, b in zip(before, d.parameters(), strict=True))


def test_a_loss_id_beyond_num_losses_and_a_foreign_optimizer_are_refused():
    g, d = nets()
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    d, opt_d = amp.initialize(d, opt_d, opt_level="O1", num_losses=2, verbosity=0)
    loss = d(torch.randn(2, 6)).mean()
    with pytest.raises(UsageError, match=r"loss_id=2 is invalid.*num_losses=2"), \
            amp.scale_loss(loss, opt_d, loss_id=2):
        pass
    with pytest.raises(UsageError, match=r"was not given to amp\.initialize"), \
            amp.scale_loss(loss, torch.optim.SGD(g.parameters(), lr=0.1)):
        pass
    with pytest.raises(UsageError, match="num_losses"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}})


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("delay", [False, True])
def test_two_scaled_losses_on_one_scaler_before_one_step_give_the_unscaled_gradients(
        opt_level, delay):
    """Without ``num_losses``: both losses share loss scaler 0, as in scripts that never
    declared several (the second scale_loss must not leave the first's gradients scaled)."""
    _, d = nets()
    d_ref = copy.deepcopy(d)
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    d, opt = amp.initialize(d, opt, opt_level=opt_level, loss_scale=1024.0, verbosity=0)
    torch.manual_seed(1)
    a, b = torch.randn(5, 6), torch.randn(5, 6)

    def two_losses(model):
        with torch.autocast("cpu", dtype=torch.float16, enabled=opt_level == "O1"):
            return model(a).float().pow(2).mean(), model(b).float().abs().mean()

    first, second = two_losses(d)
    with amp.scale_loss(first, opt, delay_unscale=delay) as scaled:
        scaled.backward()
    with amp.scale_loss(second, opt) as scaled:
        scaled.backward()
    if opt_level == "O2":
        d_ref = d_ref.half()
        d_ref.register_forward_pre_hook(lambda _m, x: tuple(t.half() for t in x))
    r_first, r_second = two_losses(d_ref)
    params = list(d_ref.parameters())
    pairs = zip(torch.autograd.grad(r_first, params), torch.autograd.grad(r_second, params),
                strict=True)
    want = [(x + y).float() if delay else x.float() + y.float() for x, y in pairs]
    got = [p.grad.float() for group in opt.param_groups for p in group["params"]]
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
