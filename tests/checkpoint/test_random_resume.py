"""A resumed run lies on the uninterrupted run's loss curve bit for bit, even when its step draws
from torch's global generator (dropout, noise), under every backend: real 2-rank gloo jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import find_free_port, run_mpt, worker

SAVE_AT = 2  # mid-epoch: the resumed run's first batch comes from a fresh pass of the loader
BACKENDS = [pytest.param("ddp"), pytest.param("horovod", marks=pytest.mark.slow),
            pytest.param("apex", marks=pytest.mark.slow),
            pytest.param("deepspeed", marks=pytest.mark.slow),
            pytest.param("fsdp", marks=pytest.mark.slow)]


def _run(out: Path, backend: str, tag: str, *resume: str) -> dict[str, float]:
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(find_free_port()),
                     "--backend", backend, worker("noisy_resume.py"), str(out), tag,
                     str(SAVE_AT), str(out / "ckpt"), *resume, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / f"{tag}.json").read_text())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_noisy_run_repeats_the_uninterrupted_losses_exactly(tmp_path, backend):
    whole = _run(tmp_path, backend, "whole")
    resumed = _run(tmp_path, backend, "resumed", "--resume")
    assert sorted(resumed, key=int) == [str(s) for s in range(SAVE_AT + 1, len(whole) + 1)]
    assert {step: whole[step] for step in resumed} == resumed
