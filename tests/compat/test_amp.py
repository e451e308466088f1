"""``mpt.compat.apex``: Apex's amp API on native torch, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpt.compat.apex import amp
from mpt.errors import UsageError


@pytest.fixture(autouse=True)
def fresh_amp(monkeypatch):
    """Each test starts before amp.initialize, one torch thread (tiny tensors, busy machine)."""
    monkeypatch.setattr(amp, "_state", None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def legacy_step(model, optimizer, inf: bool = False) -> None:
    """The loop body of an Apex-era script, unchanged."""
    x = torch.randn(6, 4)
    if inf:
        x[0, 0] = float("inf")
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()


def test_o2_through_the_apex_api_keeps_masters_and_skips_overflow():
    model, optimizer = model_and_optimizer()
    same_model, same_optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                                loss_scale=128.0, verbosity=0)
    assert same_model is model and same_optimizer is optimizer  # as Apex: patched in place
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
    masters = list(amp.master_params(optimizer))
    assert len(masters) == 6 and all(m.dtype == torch.float32 for m in masters)
    legacy_step(model, optimizer)
    legacy_step(model, optimizer, inf=True)  # a static scale: skipped, and the scale stays
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 0}}
    fp16_masters = [m for m in masters if m.shape == model[3].weight.shape]
    assert torch.equal(model[3].weight, fp16_masters[0].detach().half())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(p.grad is None for p in (model[0].weight, model[3].weight))


def test_dynamic_scale_backs_off_and_counts_unskipped_steps():
    model, optimizer = model_and_optimizer()
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    legacy_step(model, optimizer, inf=True)
    legacy_step(model, optimizer)
    legacy_step(model, optimizer)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 2}}


def test_an_apex_checkpoint_restores_the_scaler_and_round_trips():
    model, optimizer = model_and_optimizer()
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    legacy_step(model, optimizer)
    # what Apex wrote: torch.save({'model': ..., 'optimizer': ..., 'amp': amp.state_dict()})
    apex_checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                       "amp": {"loss_scaler0": {"loss_scale": 2048.0, "unskipped": 17}}}
    model2, optimizer2 = model_and_optimizer()
    model2, optimizer2 = amp.initialize(model2, optimizer2, opt_level="O2", verbosity=0)
    model2.load_state_dict(apex_checkpoint["model"])
    optimizer2.load_state_dict(apex_checkpoint["optimizer"])
    amp.load_state_dict(apex_checkpoint["amp"])
    assert amp.state_dict() == apex_checkpoint["amp"]
    # masters follow the loaded fp16 model, as Apex re-derived them
    for master in amp.master_params(optimizer2):
        if master.shape == model2[0].weight.shape:
            assert torch.equal(master.detach().half(), model2[0].weight)
    legacy_step(model2, optimizer2)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2048.0, "unskipped": 18}


def test_amp_before_initialize_is_a_usage_error():
    loss = torch.tensor(1.0)
    with pytest.raises(UsageError, match=r"amp\.initialize"), amp.scale_loss(loss, None):
        pass
    with pytest.raises(UsageError, match=r"amp\.initialize"):
        amp.state_dict()


@pytest.mark.parametrize("kwargs", [
    {"opt_level": "O5"},
    {"opt_level": "O1", "cast_model_type": torch.float16},
    {"opt_level": "O3", "master_weights": True},
    {"opt_level": "O2", "patch_torch_functions": True},
    {"opt_level": "O2", "num_losses": 0},
])
def test_what_apex_refused_is_refused(kwargs):
    model, optimizer = model_and_optimizer()
    with pytest.raises(UsageError):
        amp.initialize(model, optimizer, verbosity=0, **kwargs)


def test_disabled_amp_changes_nothing_and_closures_are_refused():
    model, optimizer = model_and_optimizer()
    assert amp.initialize(model, optimizer, enabled=False) == (model, optimizer)
    assert model[0].weight.dtype == torch.float32
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    with pytest.raises(UsageError, match="closure"):
        optimizer.step(lambda: 0.0)
