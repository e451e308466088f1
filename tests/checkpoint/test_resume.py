"""Resume across world sizes on real 2-rank gloo jobs: world size 2 -> 1 -> 2, full and sharded.

Three `mpt launch` jobs chained (~40 s on 2 cores): A (2 ranks) trains 15 steps and saves at
step 8, mid-epoch, in both the full and the sharded (torch.distributed.checkpoint) variant,
asynchronously (`--async-save`: training goes on while a thread writes);
B (1 rank) resumes from each of A's saves and saves again at step 11, mid-epoch; C (2 ranks)
resumes from each of B's. Every resumed run must reproduce A's losses and final weights, see the
very samples A saw at each step, and draw the random numbers its saving rank would have drawn.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from conftest import find_free_port, run_mpt, worker

SAMPLES, GLOBAL_BATCH, STEPS = 48, 8, 15  # as in workers/ckpt_resume.py
A_SAVES, B_SAVES = 8, 11
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH


def _launch(ranks: int, out: Path, tag: str, save_at: int, *checkpoints: Path,
            backend: str = "ddp", options: Sequence[str] = (), full_only: bool = False,
            env: dict[str, str] | None = None) -> None:
    """One job of workers/ckpt_resume.py; the backend matrix (test_matrix.py) passes another
    backend and its launch ``options`` (``--zero-stage 3``, ``--precision O2``)."""
    result = run_mpt("launch", "--gpus", str(ranks), "--master-port", str(find_free_port()),
                     "--backend", backend, *options,
                     worker("ckpt_resume.py"), str(out), tag, str(save_at),
                     str(out / f"ckpt-{tag}"), *map(str, checkpoints),
                     *(["--full-only"] if full_only else []), timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("resume")
    _launch(2, out, "a", A_SAVES, options=("--async-save",))  # B's saves are synchronous
    _launch(1, out, "b", B_SAVES, out / "ckpt-a" / "full", out / "ckpt-a" / "sharded")
    _launch(2, out, "c", 0, out / "ckpt-b" / "full", out / "ckpt-b" / "sharded")
    return {p.name.rsplit("-rank", 1)[0]: [json.loads(q.read_text()) for q in
                                          sorted(out.glob(p.name.rsplit("-rank", 1)[0] + "-rank*"))]
            for p in out.glob("*-rank0.json")}


RESUMED = {"b-0": ("full", 2, 1), "b-1": ("sharded", 2, 1),
           "c-0": ("full", 1, 2), "c-1": ("sharded", 1, 2)}


@pytest.mark.parametrize("run", sorted(RESUMED))
def test_resuming_at_another_world_size_continues_the_loss_curve(runs, run):
    original, resumed = runs["a"][0], runs[run][0]
    assert original["async_save"] and not resumed["async_save"]
    saved_at = A_SAVES if run.startswith("b") else B_SAVES
    assert resumed["world_size"] == RESUMED[run][2] and len(runs[run]) == RESUMED[run][2]
    assert resumed["info"] == {"step": saved_at, "epoch": saved_at // STEPS_PER_EPOCH,
                               "note": "mid-epoch"}
    assert sorted(map(int, resumed["loss"])) == list(range(saved_at + 1, STEPS + 1))
    for step, loss in resumed["loss"].items():
        assert loss == pytest.approx(original["loss"][step], abs=1e-6), step
    for got, want in zip(resumed["params"], original["params"], strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    # StepLR(step_size=4, gamma=0.5) from lr 0.01 after 8 or 11 steps: 0.01 * 0.5**2
    assert resumed["lr"] == [pytest.approx(0.0025)]


def _global_samples(ranks: list[dict], step: int) -> list[int]:
    return sorted(i for rank in ranks for i in rank["idx"].get(str(step), []))


@pytest.mark.parametrize("run", sorted(RESUMED))
def test_resuming_mid_epoch_neither_repeats_nor_skips_samples(runs, run):
    saved_at = A_SAVES if run.startswith("b") else B_SAVES
    for step in range(saved_at + 1, STEPS + 1):  # the very samples the original run took
        assert _global_samples(runs[run], step) == _global_samples(runs["a"], step), step
    epoch = saved_at // STEPS_PER_EPOCH
    steps = range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
    # who trained each step of that epoch: A up to its save, then B (up to its save), then run
    trainer = {s: runs["a"] if s <= A_SAVES else runs["b-0"] if s <= saved_at else runs[run]
               for s in steps}
    seen = [i for s in steps for i in _global_samples(trainer[s], s)]
    assert sorted(seen) == list(range(SAMPLES))  # the interrupted epoch: each sample once


@pytest.mark.parametrize("run", sorted(RESUMED))
def test_every_rank_gets_back_the_random_state_of_its_saving_rank(runs, run):
    saver = runs["a"] if run.startswith("b") else runs["b-0"]
    for rank, resumed in enumerate(runs[run]):
        if rank < len(saver):
            assert resumed["loaded_draws"] == saver[rank]["saved_draws"]
        else:  # a rank the saving run did not have keeps its own stream
            assert resumed["loaded_draws"] != saver[0]["saved_draws"]
