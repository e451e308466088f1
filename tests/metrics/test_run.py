"""Metrics, progress and plots of real 2-rank `mpt launch` runs (and one run on a terminal)."""

from __future__ import annotations

import json
import math
import os
import pty
import re
import shutil
import struct
import subprocess
import sys

import pytest
from conftest import run_mpt, worker

BUILTIN = {"loss", "lr", "loss_scale", "skipped_steps", "grad_norm", "samples_per_s",
           "step_time_s", "memory_mib", "memory_peak_mib"}
STEPS, EVERY = 40, 5


def records(path):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0]["meta"], [r for r in lines[1:] if "loss" in r], [r for r in lines[1:]
                                                                      if "val_loss" in r]


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def all_ranks_run(tmp_path_factory):
    """One fp16 run, every rank recording, output not a terminal."""
    run_dir = tmp_path_factory.mktemp("run")
    from conftest import find_free_port

    result = run_mpt("launch", "--gpus", "2", "--precision", "fp16-mixed", "--loss-scale", "128",
                     "--master-port", str(find_free_port()), "--run-dir", str(run_dir),
                     "--log-every", str(EVERY), "--metrics-all-ranks",
                     worker("metrics_train.py"), str(STEPS))
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_every_rank_writes_jsonl_with_sane_values(all_ranks_run):
    run_dir, _ = all_ranks_run
    for rank, name in ((0, "metrics.jsonl"), (1, "metrics.rank1.jsonl")):
        meta, steps, user = records(run_dir / name)
        assert meta == {"backend": "ddp", "precision": "fp16-mixed", "world_size": 2,
                        "accumulate": 1, "rank": rank}
        assert [r["step"] for r in steps] == list(range(EVERY, STEPS + 1, EVERY))
        for r in steps:
            assert r.keys() >= BUILTIN, r
            assert math.isfinite(r["loss"]) and r["loss"] > 0
            assert r["loss_scale"] == 128.0 and r["skipped_steps"] == 0
            assert r["grad_norm"] > 0 and 0 < r["step_time_s"] < 5
            # 16 rows per rank and step, two ranks: samples/s is the job's, not one rank's.
            assert r["samples_per_s"] == pytest.approx(32 / r["step_time_s"], rel=1e-6)
            assert 50 < r["memory_mib"] <= r["memory_peak_mib"] + 1e-9
        assert steps[-1]["loss"] < steps[0]["loss"] / 3  # it trained
        # The LambdaLR halves the rate every 10 steps; a record shows the rate its step used.
        assert [r["lr"] for r in steps] == [0.05 * 0.5 ** ((r["step"] - 1) // 10) for r in steps]
        assert [(r["step"], r["epoch"]) for r in user] == [(10, 1), (20, 2), (30, 3), (40, 4)]


def test_tensorboard_event_files_hold_the_same_scalars(all_ranks_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = all_ranks_run
    for rank, name in ((0, "metrics.jsonl"), (1, "metrics.rank1.jsonl")):
        events = EventAccumulator(str(run_dir / "tensorboard" / f"rank{rank}"))
        events.Reload()
        assert BUILTIN | {"epoch", "val_loss"} <= set(events.Tags()["scalars"])
        _, steps, _ = records(run_dir / name)
        assert [(e.step, e.value) for e in events.Scalars("loss")] == [
            (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]


def test_output_that_is_no_terminal_gets_plain_progress_lines_from_rank_0(all_ranks_run):
    _, result = all_ranks_run
    # every line whole, behind its rank's prefix (`mpt launch` without --log-dir), rank 0's only
    ranked = [line.partition("]: ") for line in result.stderr.splitlines()]
    lines = [text for rank, _, text in ranked if text.startswith("step ")]
    assert {rank for rank, _, text in ranked if text.startswith("step ")} == {"[rank0"}
    assert lines[0].startswith(f"step {EVERY}/{STEPS}  loss "), result.stderr
    assert lines[-1].startswith(f"step {STEPS}/{STEPS}  loss "), result.stderr
    assert all("samples/s  scale 128  elapsed " in line for line in lines)
    assert len(lines) <= STEPS // EVERY  # one rank, at most one line per record
    assert "\r" not in result.stderr and "\x1b[" not in result.stderr
    assert "training 40 steps" in result.stdout and "finished" in result.stdout


def test_visualize_draws_every_curve_per_rank_into_pngs_and_one_html(all_ranks_run, tmp_path):
    run_dir, _ = all_ranks_run
    out = tmp_path / "plots"
    result = run_mpt("visualize", str(run_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr
    pngs = sorted(p.stem for p in out.glob("*.png"))
    assert pngs == sorted(BUILTIN - {"memory_peak_mib"} | {"epoch", "val_loss"})
    assert all(png_size(p)[0] > 400 for p in out.glob("*.png"))
    page = (out / "index.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(pngs)
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert "<td>rank 0</td><td>40</td>" in page and "<td>rank 1</td><td>40</td>" in page


def test_visualize_reads_a_run_whose_last_line_is_half_written(all_ranks_run, tmp_path):
    run_dir, _ = all_ranks_run
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(run_dir / "metrics.jsonl", live)
    with open(live / "metrics.jsonl", "a") as f:
        f.write('{"step": 45, "time": 1.0, "loss": 0.1')  # the writer is in the middle of it
    from mpt.visualize import render

    written = render(live, live / "plots")  # in this process: the CLI is tested above
    assert (live / "plots" / "loss.png") in written
    page = (live / "plots" / "index.html").read_text()
    assert "<td>rank 0</td><td>40</td>" in page and "unreadable" not in page


def test_quiet_shows_nothing_and_rank_0_alone_writes_by_default(tmp_path, free_port):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--quiet",
                     "--run-dir", str(tmp_path), "--log-every", "4", worker("metrics_train.py"),
                     "12")
    assert result.returncode == 0, result.stderr
    assert not re.search(r"^step \d", result.stderr, re.MULTILINE), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tensorboard"]
    assert [p.name for p in (tmp_path / "tensorboard").iterdir()] == ["rank0"]
    _, steps, _ = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in steps] == [4, 8, 12]
    assert {r["loss_scale"] for r in steps} == {1.0}  # fp32


def test_a_terminal_gets_a_rich_bar_with_loss_rate_and_eta(tmp_path):
    """One process, no launcher, its output a pseudo-terminal."""
    primary, secondary = pty.openpty()
    env = {**os.environ, "COLUMNS": "160", "LINES": "40", "TERM": "xterm-256color",
           "MPT_RUN_CONFIG": json.dumps({"log_every": 3, "run_dir": str(tmp_path)})}
    for var in ("NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, worker("metrics_train.py"), "12", "0.1"],
                            stdin=secondary, stdout=secondary, stderr=secondary, env=env)
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    assert "━" in screen  # the bar
    assert re.search(r"step 12/12 .*loss [\d.]+ +[\d,]+ samples/s", screen), screen
    assert "ETA" in screen and "training 12 steps" in screen and "finished" in screen
    assert not re.search(r"^step \d+/12  loss", screen, re.MULTILINE)  # no plain lines here
