"""Metrics pieces in one process: settings, the reader, plain progress lines, the runtime hooks."""

from __future__ import annotations

import io
import json

import pytest
import torch
from conftest import run_mpt
from torch import nn

import mpt
from mpt.metrics import MetricsConfig, read_metrics, read_run
from mpt.metrics.progress import PlainLines


def test_code_wins_over_launch_flags_and_bad_values_name_the_flag(tmp_path):
    env = {"MPT_RUN_CONFIG": json.dumps({"run_dir": "/from/flag", "quiet": "True",
                                         "log_every": "7", "metrics_all_ranks": "no"})}
    assert mpt.Runtime(env=env).monitor.config == MetricsConfig(
        run_dir=tmp_path.__class__("/from/flag"), quiet=True, log_every=7, all_ranks=False)
    rt = mpt.Runtime(env=env, run_dir=tmp_path, quiet=False, log_every=2, metrics_all_ranks=True)
    assert rt.monitor.config == MetricsConfig(run_dir=tmp_path, quiet=False, log_every=2,
                                              all_ranks=True)
    with pytest.raises(mpt.UsageError, match=r"^--log-every=0 is invalid"):
        mpt.Runtime(env={"MPT_RUN_CONFIG": '{"log_every": "0"}'})
    with pytest.raises(mpt.UsageError, match=r"^--quiet=maybe is invalid"):
        mpt.Runtime(env={"MPT_RUN_CONFIG": '{"quiet": "maybe"}'})


def test_reader_skips_a_half_written_last_line_and_counts_broken_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"meta": {"backend": "ddp"}}\n{"step": 1, "time": 0, "loss": 2.0}\n'
                    'garbage\n{"step": 2, "time": 0, "loss": null, "grad_norm": 3}\n'
                    '{"step": 3, "loss": 1.')
    rank = read_metrics(path, 0)
    assert rank.meta == {"backend": "ddp"} and rank.bad_lines == 1
    assert rank.series == {"loss": ([1], [2.0]), "grad_norm": ([2], [3.0])}


def test_plain_lines_come_at_most_every_interval_and_the_last_one_at_close():
    out = io.StringIO()
    lines = PlainLines(out, total=100, interval=3600)
    lines.show(10, {"loss": 0.5, "samples_per_s": 1234.0, "loss_scale": 1.0})
    lines.show(20, {"loss": 0.25, "step_time_s": 0.5, "loss_scale": 8.0, "skipped_steps": 2})
    assert out.getvalue().count("\n") == 1
    lines.close()
    first, last = out.getvalue().splitlines()
    assert first.startswith("step 10/100  loss 0.5  1,234 samples/s  elapsed 0:00:00  ETA ")
    assert last.startswith("step 20/100  loss 0.25  2.0 steps/s  scale 8  skipped 2  elapsed ")


def _train(rt, steps):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(steps):
        rt.backward(nn.functional.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1)))
        rt.clip_grad_norm_(1.0)
        rt.step()


def test_runtime_records_every_log_every_optimizer_steps_with_accumulation(tmp_path):
    rt = mpt.Runtime(env={}, accumulate=2, run_dir=tmp_path, quiet=True, log_every=2)
    rt.progress(total=3, samples_per_step=16)
    _train(rt, 6)  # 6 micro-batches: 3 optimizer steps, one record (step 2)
    rt.log(accuracy=torch.tensor(0.75))
    rt.close()
    rt.close()  # a second close (or the one at exit) does nothing
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["meta"]["accumulate"] == 2
    assert [r["step"] for r in lines[1:]] == [2, 3]
    assert lines[1]["samples_per_s"] == pytest.approx(16 / lines[1]["step_time_s"])
    assert lines[2] == {"step": 3, "time": lines[2]["time"], "accuracy": 0.75}
    assert read_run(tmp_path)[0].series["lr"] == ([2], [0.1])


def test_a_quiet_run_without_run_dir_does_nothing_per_step(capsys):
    rt = mpt.Runtime(env={}, quiet=True)
    assert not rt.monitor.active
    _train(rt, 3)
    rt.close()
    assert rt.monitor.step == 0 and capsys.readouterr().err == ""


def test_bad_input_names_the_argument_and_the_cli_exits_2_in_one_line(tmp_path):
    from mpt.visualize import command

    with pytest.raises(mpt.UsageError, match=r"^RUN_DIR=.* it holds no metrics.jsonl"):
        command(tmp_path, None, watch=False, interval="10", say=print)
    with pytest.raises(mpt.UsageError, match=r"^--interval=0 is invalid"):
        command(tmp_path, None, watch=True, interval="0", say=print)
    with pytest.raises(mpt.UsageError, match=r"^RUN_DIR=.* no such directory"):
        command(tmp_path / "nope", None, watch=False, interval="10", say=print)
    result = run_mpt("launch", "--log-every", "0", "x.py", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("mpt: error: --log-every=0 is invalid")
    assert result.stderr.count("\n") == 1, result.stderr


def test_watch_redraws_a_growing_run_until_interrupted(tmp_path, monkeypatch):
    from mpt import visualize

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 0, "loss": 2.0}\n')
    said, sleeps = [], []

    def sleep(seconds):  # the run writes a record between two looks; the third look is Ctrl-C
        sleeps.append(seconds)
        if len(sleeps) == 1:
            with path.open("a") as f:
                f.write('{"step": 2, "time": 0, "loss": 1.0}\n')
        elif len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(visualize.time, "sleep", sleep)
    visualize.command(tmp_path, None, watch=True, interval="2", say=said.append)
    assert sleeps == [2.0, 2.0, 2.0]
    assert sum("redrew" in line for line in said) == 2  # unchanged files are not redrawn
    assert said[-1] == "mpt: stopped watching"
    page = (tmp_path / "plots" / "index.html").read_text()
    assert '<meta http-equiv="refresh" content="2">' in page
    assert "<td>rank 0</td><td>2</td>" in page


def test_a_resumed_run_records_on_from_the_checkpoints_step(tmp_path):
    def run(run_dir, load, save_at=4):
        torch.manual_seed(0)
        rt = mpt.Runtime(env={}, run_dir=run_dir, quiet=True, log_every=2)
        model = nn.Linear(4, 1)
        model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        if load:
            assert rt.load(tmp_path / "ckpt")["step"] == save_at
        for step in range(1, 5):
            rt.backward(nn.functional.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1)))
            rt.step()
            if not load and step == save_at:
                rt.save(tmp_path / "ckpt", step=step)
        rt.close()
        return [(r["step"], r["step_time_s"]) for r in map(json.loads, (
            run_dir / "metrics.jsonl").read_text().splitlines()[1:])]

    assert [step for step, _ in run(tmp_path / "first", load=False)] == [2, 4]
    assert [step for step, _ in run(tmp_path / "resumed", load=True)] == [6, 8]
    # resumed at an odd step, its first step is a record: no rate yet (its window is empty)
    run(tmp_path / "odd", load=False, save_at=3)
    records = run(tmp_path / "resumed-odd", load=True, save_at=3)
    assert [step for step, _ in records] == [4, 6]
    assert records[0][1] is None and records[1][1] > 0
