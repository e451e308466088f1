"""Apex's opt levels in one process: casts, fp32 masters, loss scaling, overrides, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpt
from mpt.errors import UsageError
from mpt.precision import AmpConfig, ApexPrecision, LossScaleConfig, make_precision


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: on a loaded 2-core machine, torch's thread pool costs 0.1 s per op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def set_up(level: str, init_scale: float = 1024.0, **options):
    precision = make_precision(level, "cpu", LossScaleConfig(init_scale=init_scale), options)
    model = precision.convert_module(bn_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precision.setup_optimizer(model, optimizer)
    return precision, model, optimizer


def train_step(precision, model, optimizer, inf: bool = False) -> bool:
    x = torch.randn(6, 4)
    if inf:
        x[0, 0] = float("inf")
    with precision.autocast():
        loss = model(x).float().pow(2).mean()
    precision.scale_loss(loss).backward()
    stepped = precision.optimizer_step(optimizer)
    precision.update()
    optimizer.zero_grad(set_to_none=True)
    return stepped


def assert_o2_invariants(precision: ApexPrecision, model: nn.Module, optimizer) -> None:
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    for master in masters:
        param = precision.model_parameter(master)
        assert torch.equal(param.detach(), master.detach().to(param.dtype))
    bn = model[1]
    assert bn.weight.dtype == bn.running_mean.dtype == torch.float32
    assert model[0].weight.dtype == model[3].weight.dtype == torch.float16
    # the fp16 weights are distinct from the masters the optimizer holds
    assert {id(p) for p in masters} & {id(model[0].weight), id(model[3].weight)} == set()


def test_o2_keeps_fp32_masters_and_copies_them_into_the_fp16_model_after_every_step():
    precision, model, optimizer = set_up("O2")
    before = [p.detach().clone() for p in model.parameters()]
    log = []
    for step in range(5):
        stepped = train_step(precision, model, optimizer, inf=step == 2)
        assert_o2_invariants(precision, model, optimizer)
        log.append((stepped, precision.loss_scale))
    # the inf step is skipped and halves the scale; the others step at the scale they found
    assert log == [(True, 1024.0), (True, 1024.0), (False, 512.0), (True, 512.0),
                   (True, 512.0)]
    assert precision.skipped_steps == 1
    # (the first bias feeds batchnorm, which removes it: its gradient is zero)
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    assert changed == [True, False, True, True, True, True]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_o2_small_updates_accumulate_in_the_masters_where_fp16_would_round_them_away():
    precision, model, optimizer = set_up("O2")
    weight = model[0].weight
    master = next(m for m in optimizer.param_groups[0]["params"]
                  if precision.model_parameter(m) is weight)
    start = master.detach().clone()
    for group in optimizer.param_groups:
        group["lr"], group["momentum"] = 1e-5, 0.0
    for _ in range(20):
        train_step(precision, model, optimizer)
    # each update is below fp16's resolution near 0.3, but the fp32 masters add them up
    assert not torch.equal(master.detach(), start)
    assert torch.equal(weight.detach(), master.detach().half())


def test_o1_autocasts_fp32_weights_and_skips_an_overflowed_step():
    precision, model, optimizer = set_up("O1")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with precision.autocast():
        assert model[0](torch.randn(2, 4)).dtype == torch.float16
    assert train_step(precision, model, optimizer, inf=True) is False
    assert precision.loss_scale == 512.0 and precision.skipped_steps == 1
    assert train_step(precision, model, optimizer) is True


def test_o3_is_pure_fp16_with_a_static_scale_of_one():
    precision, model, optimizer = set_up("O3")
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert model[1].running_mean.dtype == torch.float16  # batchnorm too, unless told otherwise
    assert precision.scaler is None and precision.loss_scale == 1.0
    loss = torch.tensor(3.0)
    assert precision.scale_loss(loss) is loss
    for _ in range(3):
        assert train_step(precision, model, optimizer)
    assert precision.loss_scale == 1.0
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())


def test_o3_with_a_static_scale_unscales_the_fp16_gradients_by_hand():
    grads = {}
    for scale in (1.0, 128.0):
        precision, model, optimizer = set_up("O3", loss_scale=scale)
        torch.manual_seed(5)
        loss = model(torch.randn(6, 4)).float().pow(2).mean()
        precision.scale_loss(loss).backward()
        precision.unscale_(optimizer)
        grads[scale] = [p.grad.float() for p in model.parameters()]
        assert precision.loss_scale == scale
    for a, b in zip(grads[1.0], grads[128.0], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-4)


def test_overrides_keep_batchnorm_fp32_and_cast_model_type():
    _, model, _ = set_up("O3", keep_batchnorm_fp32="True")
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.float16
    _, model, optimizer = set_up("O2", keep_batchnorm_fp32=False)
    assert model[1].weight.dtype == torch.float16
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])
    precision, model, optimizer = set_up("O2", cast_model_type=torch.bfloat16, loss_scale=1.0)
    assert model[0].weight.dtype == torch.bfloat16 and precision.scaler is None
    assert train_step(precision, model, optimizer)


def test_bf16_variants_cast_to_bf16_without_scaling():
    precision, model, optimizer = set_up("O2-bf16")
    assert precision.name == "O2-bf16" and precision.scaler is None
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    assert train_step(precision, model, optimizer)
    master = optimizer.param_groups[0]["params"][0]
    assert master.dtype == torch.float32
    assert torch.equal(precision.model_parameter(master), master.detach().bfloat16())
    precision, model, _ = set_up("O3-bf16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_o0_changes_nothing():
    precision, model, optimizer = set_up("O0")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert precision.scaler is None and train_step(precision, model, optimizer)


def test_unknown_opt_levels_are_usage_errors_with_a_hint():
    with pytest.raises(UsageError, match="unknown opt level"):
        AmpConfig.resolve("O4")
    with pytest.raises(UsageError, match="letter O"):
        AmpConfig.resolve("02")  # the digit zero, Apex's most common typo
    with pytest.raises(UsageError, match="O2-bf16"):  # --precision lists the opt levels
        make_precision("O4", "cpu")


@pytest.mark.parametrize(("level", "options", "argument"), [
    ("O1", {"cast_model_type": torch.float16}, "cast_model_type"),
    ("O1", {"master_weights": True}, "master_weights"),
    ("O1", {"keep_batchnorm_fp32": True}, "keep_batchnorm_fp32"),
    ("O3", {"master_weights": True}, "master_weights"),
    ("O0", {"master_weights": True}, "master_weights"),
    ("O2", {"master_weights": False}, "loss_scale"),  # fp16 grads cannot be scaled dynamically
    ("O2-bf16", {"loss_scale": "dynamic"}, "loss_scale"),
    ("O2", {"keep_batchnorm_fp32": "maybe"}, "keep_batchnorm_fp32"),
    ("O2", {"loss_scale": "big"}, "--loss-scale"),
    ("O2", {"cast_model_type": "int8"}, "cast_model_type"),
    ("O2", {"opt_levle": "O1"}, "amp override"),
])
def test_contradictions_are_one_line_usage_errors(level, options, argument):
    with pytest.raises(UsageError) as caught:
        make_precision(level, "cpu", None, options)
    assert caught.value.argument == argument and "\n" not in str(caught.value)


def test_plain_precisions_refuse_options():
    with pytest.raises(UsageError, match="has no options"):
        make_precision("fp16-mixed", "cpu", None, {"master_weights": True})


def test_o2_runtime_checkpoint_keys_masters_by_model_names_and_restores_them(tmp_path):
    def runtime():
        rt = mpt.Runtime(precision="O2", env={}, precision_options={"loss_scale": 256})
        model = bn_model()
        return rt, *rt.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))

    rt, model, optimizer = runtime()
    assert rt.precision.loss_scale == 256.0  # a static override
    for _ in range(3):
        with rt.autocast():
            loss = model(torch.randn(6, 4)).pow(2).mean()
        rt.backward(loss)
        assert rt.step()
    named = rt.backend.optimizer_state_dict(model, optimizer)
    assert set(named["state"]) == {name for name, _ in model.named_parameters()}
    assert named["state"]["0.weight"]["exp_avg"].dtype == torch.float32
    # the checkpoint's weights are the fp32 masters, by the model's names; batchnorm's own
    saved = rt.backend.model_state_dict(model)
    masters = {rt.precision.model_parameter(p): p for g in optimizer.param_groups
               for p in g["params"]}
    for name, param in model.named_parameters():
        assert torch.equal(saved[name], masters[param]) and saved[name].dtype == torch.float32
    assert sum(p.dtype == torch.float16 for p in model.parameters()) == 4
    assert "master_params" not in rt.precision.state_dict()
    rt.save(tmp_path / "ckpt", step=3)

    rt2, model2, optimizer2 = runtime()
    assert rt2.load(tmp_path / "ckpt")["step"] == 3
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    masters2 = [p for g in optimizer2.param_groups for p in g["params"]]
    for a, b in zip(masters, masters2, strict=True):
        assert torch.equal(a, b)  # exact fp32, not re-widened from the fp16 model
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(optimizer2.state_dict()["state"], optimizer.state_dict()["state"])


@pytest.mark.gpu
def test_o2_on_cuda_keeps_the_same_invariants():
    precision = make_precision("O2", "cuda", LossScaleConfig(init_scale=1024.0))
    model = precision.convert_module(bn_model().cuda())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precision.setup_optimizer(model, optimizer)
    for step in range(3):
        x = torch.randn(6, 4, device="cuda")
        if step == 1:
            x[0, 0] = float("inf")
        precision.scale_loss(model(x).pow(2).mean()).backward()
        assert precision.optimizer_step(optimizer) is (step != 1)
        precision.update()
        optimizer.zero_grad(set_to_none=True)
        assert_o2_invariants(precision, model, optimizer)
    assert precision.loss_scale == 512.0


def test_o3_refuses_an_adam_eps_that_is_zero_in_fp16_and_trains_with_a_larger_one():
    precision = make_precision("O3", "cpu", LossScaleConfig.parse("128"))
    model = precision.convert_module(nn.Linear(4, 1))
    with pytest.raises(UsageError, match=r"^optimizer eps=1e-08 is invalid: it is 0 in the "
                                         r"torch.float16 parameters.*or use O2"):
        precision.setup_optimizer(model, torch.optim.Adam(model.parameters()))
    optimizer = torch.optim.Adam(model.parameters(), eps=1e-4)
    precision.setup_optimizer(model, optimizer)
    for _ in range(3):
        assert train_step(precision, model, optimizer)
    assert all(torch.isfinite(p).all() for p in model.parameters())
