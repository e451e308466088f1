"""Asynchronous saves in one process (the 2-rank case is job A of test_resume.py): what is
written is the state at the call, however far training went on meanwhile; a write that fails
leaves the previous checkpoint as the latest and raises at the next save."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import mpt
from mpt.checkpoint import find_latest, io, state


def _runtime(tmp_path, **kwargs):
    torch.manual_seed(0)
    rt = mpt.Runtime(env={}, quiet=True, checkpoint_dir=str(tmp_path / "ckpt"), **kwargs)
    model = nn.Linear(256, 256)
    model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    return rt, model, optimizer


def _train(rt, model, steps):
    for _ in range(steps):
        rt.backward(model(torch.randn(4, 256)).square().mean())
        rt.step()


def test_the_checkpoint_holds_the_state_at_the_call_while_training_goes_on(
        tmp_path, monkeypatch):
    trained_on = threading.Event()
    write = state.write_directory

    def write_after_training(*args, **kwargs):  # the writer starts once training moved on
        assert trained_on.wait(30)
        write(*args, **kwargs)

    monkeypatch.setattr(state, "write_directory", write_after_training)
    rt, model, optimizer = _runtime(tmp_path, async_save=True)
    _train(rt, model, 3)
    trained_on.set()
    rt.save(step=3, keep=2)
    _train(rt, model, 2)
    weights = model.weight.detach().clone()
    moment = optimizer.state[model.weight]["exp_avg"].clone()
    trained_on.clear()
    rt.save(step=5, keep=2)  # waits for step 3's commit first
    _train(rt, model, 1)  # changes weights and moments in place before the thread writes
    assert not torch.equal(model.weight, weights)
    trained_on.set()
    rt.save(step=6, keep=2)  # its commit prunes step 3
    rt.wait_for_save()

    root = str(tmp_path / "ckpt")
    assert find_latest(root).endswith(io.step_dir_name(6))
    assert sorted(n for n in io.Location.parse(root).listdir() if n.startswith("step-")) == [
        io.step_dir_name(5), io.step_dir_name(6)]
    assert rt.load(f"{root}/{io.step_dir_name(5)}")["step"] == 5
    assert torch.equal(model.weight, weights)
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], moment)
    rt.close()


def test_a_failed_write_keeps_the_previous_checkpoint_and_raises_at_the_next_save(
        tmp_path, monkeypatch):
    rt, model, _ = _runtime(tmp_path, async_save=True)
    _train(rt, model, 1)
    rt.save(step=1)
    rt.wait_for_save()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io, "commit", full_disk)
    _train(rt, model, 1)
    rt.save(step=2)  # returns: the write fails behind training
    with pytest.raises(OSError, match="No space left"):
        rt.save(step=3)
    monkeypatch.undo()
    assert find_latest(str(tmp_path / "ckpt")).endswith(io.step_dir_name(1))
    assert rt.load(str(tmp_path / "ckpt"))["step"] == 1
    rt.close()
