"""Several models and optimizers in one process: which optimizer steps, when an iteration ends,
the shared fp16 scale, names in checkpoints, and the one-line errors for what is ambiguous."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpt
from mpt.checkpoint import CheckpointError
from mpt.errors import UsageError
from mpt.precision import LossScaleConfig

SMALL_DYNAMIC = LossScaleConfig(init_scale=2.0**8)
"""Dynamic scaling from a scale at which these fp16 forwards' gradients stay finite (torch's
2**16 overflows them on the first step, as it does in real training)."""


def pair(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def loss_of(model: nn.Module, inf: bool = False) -> torch.Tensor:
    x = torch.randn(3, 4)
    if inf:
        x[0, 0] = float("inf")
    return model(x).float().pow(2).mean()


def test_each_optimizer_steps_alone_and_an_iteration_is_every_optimizer_once():
    rt = mpt.Runtime(env={})
    g, opt_g = rt.setup(*pair(0), name="G")
    d, opt_d = rt.setup(*pair(1), name="D")
    g0, d0 = g.weight.detach().clone(), d.weight.detach().clone()
    rt.backward(loss_of(d))
    assert rt.step(opt_d) and rt.global_step == 0  # G has not stepped yet
    assert torch.equal(g.weight, g0) and not torch.equal(d.weight, d0)
    assert d.weight.grad is None  # opt_d's gradients zeroed, and only its
    d1 = d.weight.detach().clone()
    rt.backward(loss_of(g))
    assert rt.step(opt_g) and rt.global_step == 1
    assert not torch.equal(g.weight, g0) and torch.equal(d.weight, d1)


def test_a_critic_stepping_five_times_per_generator_step_counts_one_iteration():
    rt = mpt.Runtime(precision="fp16-mixed", loss_scale=SMALL_DYNAMIC, env={})
    g, opt_g = rt.setup(*pair(0), name="G")
    d, opt_d = rt.setup(*pair(1), name="D")
    for _ in range(2):
        for _ in range(5):
            rt.backward(loss_of(d))
            assert rt.step(opt_d)  # GradScaler allows this only with an update in between
        rt.backward(loss_of(g))
        assert rt.step(opt_g)
    assert rt.global_step == 2


def test_one_shared_scale_backs_off_once_per_iteration_and_only_the_overflowed_step_skips():
    rt = mpt.Runtime(precision="fp16-mixed", loss_scale=SMALL_DYNAMIC, env={})
    g, opt_g = rt.setup(*pair(0), name="G")
    d, opt_d = rt.setup(*pair(1), name="D")
    scale = rt.precision.loss_scale
    rt.backward(loss_of(d, inf=True))
    assert rt.step(opt_d) is False
    assert rt.precision.loss_scale == scale  # not yet: G steps with the same scale
    rt.backward(loss_of(g))
    assert rt.step(opt_g) is True
    assert rt.precision.loss_scale == scale / 2 and rt.global_step == 1


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_clipping_one_optimizer_touches_only_its_gradients_at_their_true_size(precision):
    rt = mpt.Runtime(env={}, precision=precision, loss_scale=1024.0)
    g, _ = rt.setup(*pair(0), name="G")
    d, opt_d = rt.setup(*pair(1), name="D")
    plain_g, plain_d = pair(0)[0], pair(1)[0]
    x = torch.randn(3, 4)
    with rt.autocast():
        loss = d(g(x).expand(3, 4)).float().pow(2).mean()  # D's loss through G, as a GAN's
    rt.backward(loss)
    plain_d(plain_g(x).expand(3, 4)).pow(2).mean().backward()
    norm = rt.clip_grad_norm_(1e-3, optimizer=opt_d)
    want = nn.utils.clip_grad_norm_(plain_d.parameters(), 1e-3)
    assert norm.item() == pytest.approx(want.item(), rel=1e-2)  # fp16 forward: 1e-2
    scale = rt.precision.loss_scale
    # G's gradients are still scaled and unclipped (G clips, unscaled, at its own step)
    for mine, plain in zip(g.parameters(), plain_g.parameters(), strict=True):
        torch.testing.assert_close(mine.grad / scale, plain.grad, rtol=1e-2, atol=1e-6)
    for mine, plain in zip(d.parameters(), plain_d.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, plain.grad, rtol=1e-2, atol=1e-6)


def test_accumulation_is_counted_per_optimizer():
    rt = mpt.Runtime(accumulate=2, env={})
    g, opt_g = rt.setup(*pair(0), name="G")
    d, opt_d = rt.setup(*pair(1), name="D")
    seen = []
    for _ in range(2):
        rt.backward(loss_of(d))
        seen.append(rt.step(opt_d))
        rt.backward(loss_of(g))
        seen.append(rt.step(opt_g))
    assert seen == [False, False, True, True] and rt.global_step == 1


def test_a_model_without_optimizer_is_placed_and_returned_alone():
    rt = mpt.Runtime(env={})
    teacher = rt.setup(nn.Linear(4, 1), name="teacher")
    assert isinstance(teacher, nn.Linear)
    student, _ = rt.setup(*pair(0))
    rt.backward(loss_of(student))
    assert rt.step() is True  # the only optimizer


def test_ambiguous_or_unknown_arguments_are_one_line_errors():
    rt = mpt.Runtime(env={})
    model, opt = pair(0)
    g, _ = rt.setup(model, opt, name="G")
    with pytest.raises(UsageError, match=r"^name=G is invalid: a model was already set up"):
        rt.setup(*pair(1), name="G")
    with pytest.raises(UsageError, match=r"^model=Linear is invalid: this model was already"):
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rt.setup(*pair(2), name="D")
    rt.backward(loss_of(g))
    with pytest.raises(UsageError, match=r"^rt.step=\(\) is invalid: 2 optimizers are set up "
                                         r"\(G, D\).*rt.step\(optimizer\)"):
        rt.step()
    with pytest.raises(UsageError, match=r"^optimizer=SGD is invalid: this optimizer was not "
                                         r"set up.*set up: G, D"):
        rt.step(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
    with pytest.raises(UsageError, match=r"^rt.clip_grad_norm_=\(\) is invalid"):
        rt.clip_grad_norm_(1.0)
    with pytest.raises(UsageError, match=r"^model=Linear is invalid: this model was not set up"):
        rt.backward(loss_of(g), model=nn.Linear(4, 1))
    assert "\n" not in str(UsageError("a", 1, "b", "c"))


def test_checkpoints_hold_every_model_by_name_and_refuse_other_names(tmp_path):
    rt = mpt.Runtime(env={})
    g, opt_g = rt.setup(*pair(0), name="G")
    d, opt_d = rt.setup(*pair(1), name="D")
    sched = torch.optim.lr_scheduler.StepLR(opt_g, 1, gamma=0.5)
    for model, opt in ((d, opt_d), (g, opt_g)):
        rt.backward(loss_of(model))
        rt.step(opt)
    sched.step()
    saved = {n: p.detach().clone() for n, p in (("G", g.weight), ("D", d.weight))}
    rt.save(tmp_path, scheduler={"G": sched}, model=g, optimizer=opt_g)  # Fabric's habit works
    with torch.no_grad():
        g.weight.add_(1.0)
        d.weight.add_(1.0)
    sched.step()
    assert rt.load(tmp_path, scheduler={"G": sched})["step"] == 1
    assert torch.equal(g.weight, saved["G"]) and torch.equal(d.weight, saved["D"])
    assert sched.get_last_lr() == [0.05]

    other = mpt.Runtime(env={})
    other.setup(*pair(0), name="G")
    other.setup(*pair(1), name="critic")
    with pytest.raises(CheckpointError, match=r"missing \['critic'\], extra \['D'\]"):
        other.load(tmp_path)
    with pytest.raises(UsageError, match="this model was not set up"):
        rt.save(tmp_path, model=nn.Linear(4, 1))


def test_a_format_1_checkpoint_loads_as_the_model_named_model(tmp_path, monkeypatch):
    import json

    from mpt.checkpoint import io, state
    from mpt.checkpoint.format import MODEL_FILE, STATE_JSON, STATE_TENSORS

    monkeypatch.setattr(state, "FORMAT_VERSION", 1)
    weights = {"weight": torch.full((1, 4), 0.25), "bias": torch.full((1,), -1.0)}
    old = {"optimizer": None, "precision": {"skipped_steps": 0}, "scheduler": None,
           "loaders": [], "rng": [], "extra": {"note": "format 1"}}
    root = io.Location.parse(tmp_path)
    state.write_directory(root, "step-7.tmp", io.step_dir_name(7), {
        MODEL_FILE: weights, STATE_TENSORS: {}, STATE_JSON: json.dumps(old).encode()},
        manifest=dict(backend="ddp", world_size=1, precision="fp32", step=7, epoch=None,
                      sharded=False, loss_scale=1.0, parameters=5))
    rt = mpt.Runtime(env={})
    model, _ = rt.setup(*pair(0))
    assert rt.load(tmp_path) == {"step": 7, "note": "format 1"}
    assert torch.equal(model.weight, weights["weight"]) and torch.equal(model.bias,
                                                                        weights["bias"])


def test_a_model_given_to_setup_and_gone_blocks_no_new_object_at_its_address():
    """What rt.setup was given is found weakly: a model a backend replaced (a pipeline keeps
    only its stage) may be freed, and a new optimizer may get its id."""
    from mpt.pairs import Pair, Pairs

    pairs = Pairs()
    given = nn.Linear(2, 2)
    pairs.add(Pair(name="model", model=nn.Linear(2, 2), optimizer=None), given)
    address = id(given)
    del given
    newcomer = None
    for _ in range(10_000):  # CPython hands a freed object's memory to the next of its size
        candidate = nn.Linear(2, 2)
        if id(candidate) == address:
            newcomer = candidate
            break
    assert newcomer is not None, "no new object reused the address; the check proves nothing"
    assert pairs.check_new(None, newcomer, None) == "model_1"
