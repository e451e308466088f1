"""Apex's other public modules on torch: fp16_utils, optimizers, multi_tensor_apply, SyncBatchNorm.

The optimizers torch has are compared with torch's own; FusedLAMB and FusedNovoGrad, which torch
lacks, with the closed forms of their first steps and with their update rules written out in
float64 for a second one.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_mpt, worker

from mpt.compat.apex.fp16_utils import (
    FP16_Optimizer,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
)
from mpt.compat.apex.multi_tensor_apply import (
    multi_tensor_applier,
    multi_tensor_axpby,
    multi_tensor_l2norm,
    multi_tensor_scale,
)
from mpt.compat.apex.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from mpt.errors import UsageError


def trajectory(make_opt, steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("ours", "theirs"), [
    (lambda p: FusedAdam(p, lr=0.01, weight_decay=0.1),
     lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    (lambda p: FusedAdam(p, lr=0.01, weight_decay=0.1, adam_w_mode=False),
     lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1)),
    (lambda p: FusedSGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
])
def test_fused_adam_and_sgd_step_as_torch_does(ours, theirs):
    for a, b in zip(trajectory(ours), trajectory(theirs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_what_torch_cannot_do_is_one_line_naming_the_argument():
    params = [torch.nn.Parameter(torch.ones(2))]
    for make, argument in ((lambda: FusedAdam(params, bias_correction=False), "bias_correction"),
                           (lambda: FusedAdam(params, amsgrad=True), "amsgrad"),
                           (lambda: FusedSGD(params, 0.1, wd_after_momentum=True),
                            "wd_after_momentum"),
                           (lambda: FusedNovoGrad(params, norm_type=1), "norm_type")):
        with pytest.raises(UsageError) as info:
            make()
        assert info.value.argument == argument and "\n" not in str(info.value)


def one_step(opt_class, p0: torch.Tensor, grad: torch.Tensor, **kwargs) -> torch.Tensor:
    param = torch.nn.Parameter(p0.clone())
    opt = opt_class([param], **kwargs)
    param.grad = grad.clone()
    opt.step()
    return param.detach()


def test_lamb_first_step_is_the_trust_ratio_times_the_sign_of_the_gradient():
    p0, grad = torch.tensor([3.0, -4.0, 0.5]), torch.tensor([0.2, 0.1, -0.3])
    # step 1 with bias correction: m_hat = g, v_hat = g^2, so the Adam update is ~sign(g)
    update = torch.sign(grad) + 0.01 * p0  # weight_decay 0.01, decoupled (adam_w_mode)
    want = p0 - 0.1 * (p0.norm() / update.norm()) * update
    got = one_step(FusedLAMB, p0, grad, lr=0.1, eps=0.0, max_grad_norm=10.0)
    torch.testing.assert_close(got, want)
    # without weight decay the trust ratio applies only under use_nvlamb
    plain = one_step(FusedLAMB, p0, grad, lr=0.1, eps=0.0, weight_decay=0.0)
    torch.testing.assert_close(plain, p0 - 0.1 * torch.sign(grad))
    nv = one_step(FusedLAMB, p0, grad, lr=0.1, eps=0.0, weight_decay=0.0, use_nvlamb=True)
    torch.testing.assert_close(nv, p0 - 0.1 * p0.norm() / math.sqrt(3) * torch.sign(grad))


def test_lamb_second_step_clips_the_global_norm_and_follows_the_update_rule():
    p0 = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    g1, g2 = torch.tensor([3.0, 0.0, 4.0]), torch.tensor([0.3, -0.2, 0.1])
    param = torch.nn.Parameter(p0.float().clone())
    opt = FusedLAMB([param], lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.02,
                    max_grad_norm=1.0)
    p, m, v = p0.clone(), torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for step, g in enumerate((g1, g2), start=1):
        param.grad = g.clone()
        opt.step()
        g = g.double() / max(g.double().norm().item(), 1.0)  # global norm above 1 is clipped
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        update = (m / (1 - 0.9**step)) / ((v / (1 - 0.99**step)).sqrt() + 1e-6) + 0.02 * p
        p = p - 0.05 * p.norm() / update.norm() * update
    torch.testing.assert_close(param.detach().double(), p, rtol=1e-5, atol=1e-6)


def test_novograd_normalises_by_the_running_gradient_norm_per_tensor():
    p0, grad = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0])  # |g| = 5
    beta2 = 0.98
    got = one_step(FusedNovoGrad, p0, grad, lr=0.1, betas=(0.9, beta2), eps=0.0)
    # step 1: m_hat = g, the norm starts at |g|, bias-corrected by sqrt(1 - beta2)
    torch.testing.assert_close(got, p0 - 0.1 * grad * math.sqrt(1 - beta2) / 5.0)
    param = torch.nn.Parameter(p0.clone())
    opt = FusedNovoGrad([param], lr=0.1, betas=(0.9, beta2), eps=0.0, weight_decay=0.5)
    param.grad = grad.clone()
    opt.step()
    param.grad = torch.tensor([0.0, 1.0])
    opt.step()
    p1 = p0 - 0.1 * (grad * math.sqrt(1 - beta2) / 5.0 + 0.5 * p0)
    norm = math.sqrt(beta2 * 25 + (1 - beta2) * 1)
    m = 0.9 * 0.1 * grad + 0.1 * torch.tensor([0.0, 1.0])
    update = (m / (1 - 0.81)) / (norm / math.sqrt(1 - beta2**2)) + 0.5 * p1
    torch.testing.assert_close(param.detach(), p1 - 0.1 * update)


def test_fp16_optimizer_trains_a_half_model_like_fp32_and_skips_an_overflow():
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                   torch.nn.Linear(8, 1))

    half, fp32 = network_to_half(model()), model()
    assert half[1][0].weight.dtype == torch.float16 and half[1][1].weight.dtype == torch.float32
    opt = FP16_Optimizer(torch.optim.SGD(half.parameters(), lr=0.1, momentum=0.9),
                         dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 3},
                         verbose=False)
    ref_opt = torch.optim.SGD(fp32.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(half(x).float(), y))
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(fp32(x), y).backward()
        ref_opt.step()
    assert opt.loss_scale == 2.0**12  # doubled after each 3 clean steps
    for ours, theirs in zip(half.parameters(), fp32.parameters(), strict=True):
        torch.testing.assert_close(ours.float(), theirs, rtol=2e-2, atol=2e-2)
    saved = opt.state_dict()
    before = [p.detach().clone() for p in half.parameters()]
    opt.zero_grad()
    opt.backward(half(torch.full((2, 4), 6e4)).float().sum() * 1e6)  # overflows in fp16
    assert opt.overflow and opt.clip_master_grads(1.0) == -1.0
    opt.step()
    assert opt.loss_scale == 2.0**11  # backed off, step skipped
    assert all(torch.equal(a, b) for a, b in zip(before, half.parameters(), strict=True))
    opt.load_state_dict(saved)
    assert opt.loss_scale == 2.0**12 and not opt.overflow


@pytest.mark.parametrize("flat", [False, True])
def test_master_parameter_helpers_round_trip(flat):
    model = torch.nn.Linear(3, 2).half()
    model_params, masters = prep_param_lists(model, flat_master=flat)
    assert all(m.dtype == torch.float32 for m in masters) and len(masters) == (1 if flat else 2)
    model(torch.ones(1, 3, dtype=torch.half)).sum().backward()
    model_grads_to_master_grads(model_params, masters, flat_master=flat)
    grads = torch.cat([m.grad.reshape(-1) for m in masters])
    torch.testing.assert_close(grads, torch.cat([p.grad.float().reshape(-1)
                                                 for p in model_params]))
    with torch.no_grad():
        for m in masters:
            m.add_(1.0)
    before = [p.detach().float().clone() for p in model_params]
    master_params_to_model_params(model_params, masters, flat_master=flat)
    for p, b in zip(model_params, before, strict=True):
        torch.testing.assert_close(p.float(), b + 1.0, rtol=1e-3, atol=1e-3)
    assert to_python_float(torch.tensor([2.5])) == 2.5 and to_python_float(3) == 3.0
    with pytest.raises(UsageError, match="one element"):
        to_python_float(torch.ones(2))


def test_multi_tensor_ops_compute_and_flag_overflow_as_amp_c_did():
    flag = torch.zeros(1, dtype=torch.int)
    out = [torch.empty(2), torch.empty(3)]
    multi_tensor_applier(multi_tensor_scale, flag, [[torch.ones(2), torch.full((3,), 2.0)], out],
                         0.5)
    assert out[1].tolist() == [1.0] * 3 and flag.item() == 0
    multi_tensor_applier(multi_tensor_axpby, flag, [[torch.ones(2)], [torch.tensor([1.0, 2.0])],
                                                    [out[0]]], 2.0, 3.0, -1)
    assert out[0].tolist() == [5.0, 8.0] and flag.item() == 0
    total, each = multi_tensor_applier(multi_tensor_l2norm, flag,
                                       [[torch.tensor([3.0]), torch.tensor([4.0])]], True)
    assert total.item() == 5.0 and each.tolist() == [3.0, 4.0]
    multi_tensor_applier(multi_tensor_scale, flag, [[torch.tensor([math.inf])], [out[0][:1]]],
                         1.0)
    assert flag.item() == 1


def test_sync_batch_norm_on_two_cpu_ranks_is_batch_norm_over_the_whole_batch(tmp_path,
                                                                             free_port):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port),
                     worker("syncbn_check.py"), str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
