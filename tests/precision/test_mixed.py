"""Loss scaling in one process: overflow skips, scale schedule, one unscale per step, state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpt.errors import UsageError
from mpt.precision import LossScaleConfig, MixedPrecision, make_precision


def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def backward(precision, model, inf: bool = False) -> None:
    x = torch.randn(3, 4)
    if inf:
        x[0, 0] = float("inf")
    with precision.autocast():
        loss = model(x).float().pow(2).mean()
    precision.scale_loss(loss).backward()


def test_overflow_skips_the_step_and_backs_off():
    p = MixedPrecision("cpu", torch.float16, LossScaleConfig(init_scale=256.0))
    model, opt = model_and_opt()
    before = [t.detach().clone() for t in model.parameters()]
    backward(p, model, inf=True)
    assert p.optimizer_step(opt) is False
    p.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert p.loss_scale == 128.0 and p.skipped_steps == 1
    opt.zero_grad()
    backward(p, model)
    assert p.optimizer_step(opt) is True and p.skipped_steps == 1


def test_scale_grows_after_the_growth_interval():
    p = MixedPrecision("cpu", torch.float16, LossScaleConfig(init_scale=8.0, growth_interval=3))
    model, opt = model_and_opt()
    scales = []
    for _ in range(6):
        backward(p, model)
        p.optimizer_step(opt)
        p.update()
        opt.zero_grad()
        scales.append(p.loss_scale)
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0]


def test_static_scale_never_moves_but_still_skips_overflow():
    p = make_precision("fp16-mixed", "cpu", LossScaleConfig.parse("64"))
    model, opt = model_and_opt()
    backward(p, model, inf=True)
    assert p.optimizer_step(opt) is False
    p.update()
    assert p.loss_scale == 64.0
    for _ in range(3):
        opt.zero_grad()
        backward(p, model)
        assert p.optimizer_step(opt) is True
        p.update()
    assert p.loss_scale == 64.0 and p.skipped_steps == 1


def test_gradients_are_unscaled_exactly_once_for_clip_and_step():
    p = MixedPrecision("cpu", torch.float16, LossScaleConfig(init_scale=1024.0))
    ref = make_precision("fp32", "cpu")
    model, opt = model_and_opt()
    model32, _ = model_and_opt()
    torch.manual_seed(1)
    backward(p, model)
    torch.manual_seed(1)
    backward(ref, model32)
    p.unscale_(opt)
    p.unscale_(opt)  # a second call (clip, then step) must not divide again
    for got, want in zip(model.parameters(), model32.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-2, atol=1e-3)
    assert p.optimizer_step(opt)


def test_bf16_needs_no_scaler():
    p = make_precision("bf16-mixed", "cpu")
    model, _ = model_and_opt()
    with p.autocast():
        assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    assert p.scaler is None and p.loss_scale == 1.0


def test_state_dict_round_trip():
    p = MixedPrecision("cpu", torch.float16, LossScaleConfig(init_scale=512.0))
    model, opt = model_and_opt()
    backward(p, model, inf=True)
    p.optimizer_step(opt)
    p.update()
    state = p.state_dict()
    q = MixedPrecision("cpu", torch.float16)
    q.load_state_dict(state)
    assert q.loss_scale == 256.0 and q.skipped_steps == 1 and q.state_dict() == state


@pytest.mark.parametrize("kwargs", [{"init_scale": 0.0}, {"growth_factor": 1.0},
                                    {"backoff_factor": 1.5}, {"growth_interval": 0}])
def test_bad_scaler_settings_are_usage_errors(kwargs):
    with pytest.raises(UsageError):
        LossScaleConfig(**kwargs)
