"""The Runtime in one process: settings precedence, accumulation, clipping, data, save/load."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpt
from mpt.data import DistributedLoader
from mpt.errors import UsageError


def test_launch_flags_apply_where_the_code_is_silent_and_code_wins():
    env = {"MPT_PRECISION": "bf16-mixed", "MPT_ACCUMULATE": "4"}
    rt = mpt.Runtime(env=env)
    assert (rt.backend.name, rt.precision.name, rt.accumulate) == ("ddp", "bf16-mixed", 4)
    rt = mpt.Runtime(precision="fp16-mixed", accumulate=1, env=env)
    assert (rt.precision.name, rt.accumulate) == ("fp16-mixed", 1)
    assert rt.world == mpt.World() and rt.world_size == 1 and rt.is_global_zero


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"backend": "nope"}, "--backend"), ({"precision": "fp4"}, "--precision"),
    ({"accumulate": 0}, "accumulate"), ({"loss_scale": "huge"}, "--loss-scale"),
])
def test_bad_settings_name_the_argument(kwargs, argument):
    with pytest.raises(mpt.UsageError, match=f"^{argument}="):
        mpt.Runtime(env={}, **kwargs)


def test_accumulation_steps_and_clips_once_per_k_micro_batches():
    rt = mpt.Runtime(accumulate=3, env={})
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    results = []
    for _ in range(6):
        rt.backward(model(torch.randn(2, 4)).pow(2).mean())
        norm = rt.clip_grad_norm_(1e-3)
        results.append((norm is not None, rt.step()))
        if norm is not None:
            assert norm > 1e-3  # the clip did see the accumulated gradient
    assert results == [(False, False), (False, False), (True, True)] * 2
    assert all(p.grad is None for p in model.parameters())  # step() zeroed them


def test_accumulating_k_micro_batches_equals_one_batch_k_times_larger():
    torch.manual_seed(0)
    x, y = torch.randn(12, 4), torch.randn(12, 1)

    def train(accumulate: int) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = nn.Linear(4, 1)
        rt = mpt.Runtime(accumulate=accumulate, env={})
        model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for _ in range(3):
            for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
                rt.backward(nn.functional.mse_loss(model(xs), ys))
                rt.step()
        return [p.detach() for p in model.parameters()]

    for a, b in zip(train(4), train(1), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_save_and_load_restore_model_optimizer_and_extras(tmp_path):
    torch.manual_seed(0)
    rt = mpt.Runtime(precision="fp16-mixed", loss_scale=64.0, env={})
    model = nn.Linear(4, 2)
    model, opt = rt.setup(model, torch.optim.Adam(model.parameters()))
    for _ in range(2):
        with rt.autocast():
            loss = model(torch.randn(3, 4)).float().sum()
        rt.backward(loss)
        rt.step()
    rt.save(tmp_path / "ckpt.pt", step=2, epoch=1)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.state.clear()
    rt.precision.skipped_steps = 5
    assert rt.load(tmp_path / "ckpt.pt") == {"step": 2, "epoch": 1}
    assert rt.precision.skipped_steps == 0 and rt.precision.loss_scale == 64.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k])
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], want_opt)


def test_ranks_get_disjoint_shards_reshuffled_every_epoch():
    data = TensorDataset(torch.arange(20))
    loaders = [DistributedLoader(DataLoader(data, batch_size=5, shuffle=True), rank=r,
                                 world_size=2, device=torch.device("cpu")) for r in range(2)]
    epochs = []
    for _ in range(2):
        seen = [torch.cat([b[0] for b in loader]).tolist() for loader in loaders]
        assert sorted(seen[0] + seen[1]) == list(range(20))  # every sample once per epoch
        epochs.append(seen[0])
    assert epochs[0] != epochs[1] and loaders[0].epoch == 2


def test_training_before_setup_says_what_to_do():
    rt = mpt.Runtime(env={})
    for call in (rt.step, lambda: rt.backward(torch.ones(())), lambda: rt.clip_grad_norm_(1.0),
                 lambda: rt.save("unused")):
        with pytest.raises(UsageError, match=r"rt\.setup\(model, optimizer\) first"):
            call()


def test_backend_options_from_the_launcher_and_from_code_are_checked_by_the_backend():
    env = {"MPT_BACKEND_OPTIONS": json.dumps({"bucket": 1})}
    with pytest.raises(UsageError, match=r"bucket.*'ddp' has no such option"):
        mpt.Runtime(env=env)
    with pytest.raises(UsageError, match="zero_stage"):
        mpt.Runtime(backend_options={"zero_stage": 2}, env={})
