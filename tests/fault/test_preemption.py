"""Preemption in one process (the agreement, resume choices) and through real launches."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import mpt_command, pid_alive, worker
from torch import nn

import mpt
from mpt.errors import UsageError
from mpt.fault import REQUEUE_EXIT_CODE, Preemption


class Exchange:
    """Sums between two in-process 'ranks' the way a backend's ``sum_async`` does: the i-th sum
    a rank starts adds up what both ranks gave to their i-th sums."""

    def __init__(self) -> None:
        self.given: list[list[torch.Tensor]] = [[], []]

    def sum_async(self, rank: int):
        def start(tensor: torch.Tensor):
            self.given[rank].append(tensor.clone())
            i = len(self.given[rank]) - 1
            return lambda: tensor.copy_(self.given[0][i] + self.given[1][i])
        return start


def test_both_ranks_stop_after_the_same_step_soon_after_one_was_asked():
    ranks, exchange = [Preemption(), Preemption()], Exchange()
    stopped: list[list[int]] = [[], []]
    for step in range(1, 300):
        if step == 150:
            ranks[1].requested = True  # the signal reached rank 1 only
        time.sleep(0.01)  # a 10 ms step: the checks fall every ~50 steps
        for rank, preemption in enumerate(ranks):
            if preemption.should_stop(exchange.sum_async(rank), world_size=2):
                stopped[rank].append(step)
    assert stopped[0] and stopped[0] == stopped[1]
    every = ranks[0].every
    assert every == ranks[1].every and 10 <= every <= 50  # about CHECK_INTERVAL / 10 ms
    assert 150 < stopped[0][0] <= 150 + 2 * every + 1


def test_the_signal_sets_the_request_and_a_scripts_own_handler_wins():
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        preemption = Preemption()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested
        mine = []
        signal.signal(signal.SIGUSR1, lambda *_: mine.append(1))
        kept = Preemption()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mine == [1] and not kept.requested
    finally:
        signal.signal(signal.SIGUSR1, previous)


def small_run(tmp_path: Path, **kwargs) -> mpt.Runtime:
    rt = mpt.Runtime(checkpoint_dir=str(tmp_path / "ck"), env={}, **kwargs)
    model = nn.Linear(3, 1)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return rt


def train(rt: mpt.Runtime, steps: int) -> None:
    for _ in range(steps):
        rt.backward(rt.pairs.pairs[0].model(torch.ones(2, 3)).sum())
        rt.step()


def test_resume_auto_starts_afresh_then_resumes_the_latest(tmp_path):
    rt = small_run(tmp_path)
    assert rt.resume() == {"step": 0}
    train(rt, 3)
    assert rt.global_step == 3
    rt.save()  # into checkpoint_dir, at global_step
    assert (tmp_path / "ck/step-000000003").is_dir()
    again = small_run(tmp_path)
    assert again.resume()["step"] == 3 and again.global_step == 3
    assert torch.equal(again.pairs.pairs[0].model.weight, rt.pairs.pairs[0].model.weight)


def test_resume_never_refuses_to_overwrite_and_a_path_must_hold_a_checkpoint(tmp_path):
    rt = small_run(tmp_path)
    train(rt, 1)
    rt.save()
    with pytest.raises(UsageError, match=r"--resume=never.*already holds"):
        small_run(tmp_path, resume="never").resume()
    assert small_run(tmp_path, resume=str(tmp_path / "ck")).resume()["step"] == 1
    with pytest.raises(UsageError, match=r"resume=.*no checkpoint there"):
        small_run(tmp_path, resume=str(tmp_path / "nothing"))
    nowhere = mpt.Runtime(env={})
    model = nn.Linear(3, 1)
    nowhere.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UsageError, match=r"rt\.save needs a directory"):
        nowhere.save()


def test_a_bad_timeout_is_refused():
    with pytest.raises(UsageError, match="--timeout=0"):
        mpt.Runtime(env={"MPT_TIMEOUT": "0"})
    assert mpt.Runtime(env={"MPT_TIMEOUT": "2.5"}).backend.timeout.total_seconds() == 2.5


def test_a_preempted_horovod_job_saves_and_exits_75(tmp_path):
    """ddp and deepspeed are in tests/launchers/test_faults.py; horovodrun relays it too."""
    ck = tmp_path / "ck"
    proc = subprocess.Popen(mpt_command("launch", "--gpus", "2", "--backend", "horovod",
                                        "--checkpoint-dir", str(ck), "--quiet",
                                        worker("preempt_train.py"), str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "step5").exists():  # a few steps in
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == REQUEUE_EXIT_CODE, stderr
    assert "preempted" in stderr
    saved = mpt.checkpoint.find_latest(ck)
    assert saved is not None and int(saved.rsplit("-", 1)[1]) >= 5
    assert not any(pid_alive(p) for p in pids)


def test_an_epoch_loop_resumes_from_the_loaders_epoch_mid_epoch(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    def run(stop_at: int | None) -> list[tuple[int, float]]:
        rt = small_run(tmp_path)
        data = TensorDataset(torch.arange(12.0).view(-1, 1).repeat(1, 3))
        loader = rt.setup_dataloader(DataLoader(data, batch_size=2, shuffle=True))
        rt.resume()
        seen = []
        for epoch in range(loader.epoch, 3):
            for (x,) in loader:
                rt.backward(rt.pairs.pairs[0].model(x).sum())
                rt.step()
                seen.append((epoch, *x[:, 0].tolist()))
                if rt.global_step == stop_at:
                    rt.save()
                    return seen
        return seen

    first = run(stop_at=8)  # 6 batches per epoch: 2 batches into epoch 1
    rest = run(stop_at=None)
    assert [e for e, *_ in first] == [0] * 6 + [1] * 2
    assert [e for e, *_ in rest] == [1] * 4 + [2] * 6
    epoch1 = sorted(v for e, *xs in first + rest if e == 1 for v in xs)
    assert epoch1 == [float(i) for i in range(12)]  # the rest of epoch 1, none seen twice
