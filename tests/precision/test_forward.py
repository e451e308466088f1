"""``mpt.precision.forward``: the forward of a set-up model autocasts with no context around it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mpt
from mpt.compat.apex import amp
from mpt.precision.forward import AutocastForward, cast_floats


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def hidden_dtypes(module: nn.Sequential) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    module[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def test_forward_autocasts_and_returns_fp32_outputs():
    net = AutocastForward("cpu", torch.bfloat16).attach(model())
    seen = hidden_dtypes(net)
    out = net(torch.randn(2, 4))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # left behind the forward


def test_a_caller_autocast_decides_and_outputs_stay_as_it_left_them():
    net = AutocastForward("cpu", torch.bfloat16).attach(model())
    seen = hidden_dtypes(net)
    with torch.autocast("cpu", dtype=torch.float16):
        out = net(torch.randn(2, 4))
    assert seen == [torch.float16] and out.dtype == torch.float16


def test_a_forward_that_raises_leaves_autocast_off():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    net = AutocastForward("cpu", torch.bfloat16).attach(Boom())
    with pytest.raises(RuntimeError, match="boom"):
        net(torch.randn(2))
    assert not torch.is_autocast_enabled("cpu")


def test_the_hooked_model_pickles_and_copies():
    net = AutocastForward("cpu", torch.bfloat16).attach(model())
    for other in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        seen = hidden_dtypes(other)
        assert other(torch.randn(2, 4)).dtype == torch.float32 and seen == [torch.bfloat16]


def test_cast_floats_keeps_containers_and_other_dtypes():
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    half = torch.ones(2, dtype=torch.bfloat16)
    got = cast_floats(OrderedDict(x=Pair(half, torch.ones(2, dtype=torch.float64)),
                                  n=[torch.ones(2, dtype=torch.int64)]),
                      torch.float32, only=torch.bfloat16)
    assert type(got) is OrderedDict and type(got["x"]) is Pair
    assert (got["x"].a.dtype, got["x"].b.dtype, got["n"][0].dtype) == (
        torch.float32, torch.float64, torch.int64)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_runtime_trains_the_same_without_rt_autocast(precision):
    def curve(use_context: bool) -> list[float]:
        with mpt.Runtime(precision=precision, env={}) as rt:
            net = model()
            net, _ = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
            torch.manual_seed(1)
            losses = []
            for _ in range(4):
                x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
                if use_context:
                    with rt.autocast():
                        loss = F.cross_entropy(net(x), y)
                else:
                    loss = F.cross_entropy(net(x), y)
                rt.backward(loss)
                rt.step()
                losses.append(loss.item())
            return losses

    with_context, without = curve(True), curve(False)
    assert with_context == without and len(set(without)) > 1


def test_fp32_adds_no_hooks():
    with mpt.Runtime(precision="fp32", env={}) as rt:
        net = rt.setup(model())
        assert not net._forward_pre_hooks and not net._forward_hooks


def test_compat_o1_autocasts_the_initialized_models(monkeypatch):
    monkeypatch.setattr(amp, "_state", None)
    net = model()
    seen = hidden_dtypes(net)
    net, _ = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O1",
                            verbosity=0)
    out = net(torch.randn(2, 4))
    assert seen == [torch.float16] and out.dtype == torch.float16  # as Apex's O1 left them
    monkeypatch.setattr(amp, "_state", None)
    net = model()
    net, _ = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O1",
                            cast_model_outputs=torch.float32, verbosity=0)
    assert net(torch.randn(2, 4)).dtype == torch.float32
