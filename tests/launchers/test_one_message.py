"""One failure, one message: a refusal raised on every rank at ``rt.setup`` reaches the
console once, then mpt's summary; torch elastic's own report of the failure goes to
``--log-dir`` (``elastic.node<nr>.log``), and the error is in the log of a rank that raised it."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import run_mpt

REFUSED = """\
import torch

import mpt

rt = mpt.Runtime(quiet=True)
model = torch.nn.Linear(4, 4)
rt.setup(model, torch.optim.Adam(model.parameters(), eps=1e-8))  # O3: eps is 0 in fp16
"""
ERROR = "mpt: error: optimizer eps=1e-08 is invalid"
SUMMARY = re.compile(r"mpt: rank (\d) \(node 0, local rank \1\) exited with code 2; the job was "
                     r"stopped")
"""Either rank may be the one named: both refuse, a few milliseconds apart."""


def test_a_refusal_on_every_rank_is_printed_once_then_the_summary(tmp_path, free_port):
    script = tmp_path / "refused.py"
    script.write_text(REFUSED)
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--precision",
                     "O3", str(script))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 3, result.stderr  # the CPU notice, the error, the summary
    assert lines[0].startswith("mpt: no CUDA device here")
    # Said by the rank that claimed it first, so after that rank's prefix, as its other lines.
    said = re.fullmatch(r"\[rank([01])\]: (.*)", lines[1])
    assert said and said.group(2).startswith(ERROR) and lines[1].count("mpt: error") == 1, lines
    assert SUMMARY.fullmatch(lines[2]), lines[2]


def launch_with_log_dir(tmp_path: Path, port: int, source: str) -> tuple[list[str], Path]:
    """`mpt launch --gpus 2 --precision O3 --log-dir` of ``source``, refused (exit 2): its
    console lines and its log directory."""
    script = tmp_path / "refused.py"
    script.write_text(source)
    logs = tmp_path / "logs"
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(port), "--precision",
                     "O3", "--log-dir", str(logs), str(script))
    assert result.returncode == 2
    return (result.stdout + result.stderr).splitlines(), logs


def test_with_a_log_dir_the_launchers_report_is_kept_there(tmp_path, free_port):
    console, logs = launch_with_log_dir(tmp_path, free_port, REFUSED)
    # Once: from the tee'd rank 0, or from the launcher where the rank that failed first is
    # off the console and rank 0 had not said it (the agent may stop rank 0 before its refusal).
    errors = [line for line in console if "mpt: error" in line]
    assert len(errors) == 1 and errors[0].removeprefix("[rank0]: ").startswith(ERROR), console
    assert SUMMARY.fullmatch(console[-1]) and not any("exitcode" in line for line in console)
    assert any(ERROR in (logs / f"rank{rank}.log").read_text() for rank in (0, 1))
    assert "failed (exitcode: 2)" in (logs / "elastic.node0.log").read_text()


def test_with_a_log_dir_a_refusal_on_a_rank_off_the_console_is_shown_once(tmp_path, free_port):
    """Rank 1 refuses, rank 0 (the console's) waits for it: the launcher shows rank 1's error."""
    console, logs = launch_with_log_dir(tmp_path, free_port, REFUSED.replace(
        "eps=1e-8", "eps=1e-4 if rt.rank == 0 else 1e-8") + "rt.barrier()\n")
    errors = [line for line in console if "mpt: error" in line]
    assert len(errors) == 1 and errors[0].startswith(ERROR), console
    assert console[-1] == "mpt: rank 1 (node 0, local rank 1) exited with code 2; the job was " \
                          "stopped", console
    assert ERROR in (logs / "rank1.log").read_text()
