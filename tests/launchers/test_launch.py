"""`mpt launch` end to end: real processes on this machine, gloo, CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import find_free_port, mpt_command, pid_alive, run_mpt, wait_for, worker


def read_reports(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def test_workers_get_ranks_backend_and_precision_from_the_flags(tmp_path, free_port):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port),
                     "--precision", "bf16-mixed", worker("report_world.py"), str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "running 2 CPU process(es) per node on gloo" in result.stderr
    reports = read_reports(tmp_path, 2)
    for rank, rep in enumerate(reports):
        assert (rep["rank"], rep["local_rank"], rep["nr"]) == (rank, rank, 0)
        assert (rep["world_size"], rep["source"]) == (2, "torchelastic")
        assert (rep["backend"], rep["precision"]) == ("ddp", "bf16-mixed")
        assert rep["sum"] == 3.0  # 1 + 2: the allreduce crossed processes


def test_two_launchers_on_loopback_form_one_two_node_job(tmp_path, free_port):
    common = ["launch", "--nodes", "2", "--gpus", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port)]
    procs = [subprocess.Popen(mpt_command(*common, "--nr", str(nr), worker("report_world.py"),
                                          str(tmp_path)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for nr in (1, 0)]  # the second node may come first
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
    reports = read_reports(tmp_path, 2)
    assert [(r["rank"], r["nr"], r["local_rank"]) for r in reports] == [(0, 0, 0), (1, 1, 0)]
    assert all(r["nodes"] == 2 and r["world_size"] == 2 and r["sum"] == 3.0 for r in reports)


@pytest.mark.parametrize(("mode", "code", "how"), [
    ("exit", 3, "exited with code 3"), ("kill", 128 + 9, "was killed by SIGKILL")])
def test_a_failing_rank_ends_the_job_with_its_code(tmp_path, free_port, mode, code, how):
    start = time.monotonic()
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port),
                     worker("exit_code.py"), str(tmp_path), mode, timeout=60)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    # Measured from the failure (rank 1 fails ~0.5 s after both pids are written).
    failed_at = max((tmp_path / f"pid{r}").stat().st_mtime for r in range(2)) + 0.5
    assert result.returncode == code, result.stderr
    assert time.time() - failed_at < 10, "the launcher took too long to end the job"
    # rank 0 fails too ("connection closed by peer"), but rank 1 is named: it failed first
    assert f"mpt: rank 1 (node 0, local rank 1) {how}" in result.stderr
    assert time.monotonic() - start < 60
    assert not any(pid_alive(p) for p in pids), "a worker outlived the job"


def test_workers_die_with_a_killed_launcher(tmp_path, free_port):
    # TMPDIR: the SIGKILLed launcher leaves its launch folder in tmp_path, not in /tmp
    proc = subprocess.Popen(mpt_command("launch", "--gpus", "2", "--master-port", str(free_port),
                                        worker("report_world.py"), str(tmp_path), "120"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert wait_for(lambda: all((tmp_path / f"rank{r}.json").exists() for r in range(2)), 60)
        pids = [rep["pid"] for rep in read_reports(tmp_path, 2)]
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup code of the launcher runs
        proc.wait(timeout=10)
        assert wait_for(lambda: not any(pid_alive(p) for p in pids), 10), "orphaned workers"
    finally:
        proc.kill()


def test_dry_run_prints_every_process_and_starts_none(tmp_path):
    result = run_mpt("launch", "--dry-run", "--nodes", "2", "--gpus", "2", "--nr", "1",
                     worker("report_world.py"), str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = [line.split("│")[1:5] for line in result.stdout.splitlines() if line.count("│") == 5]
    table = [tuple(cell.strip() for cell in row) for row in rows]
    assert table == [("0", "0", "0", "cpu"), ("0", "1", "1", "cpu"),
                     ("1", "0", "2", "cpu"), ("1", "1", "3", "cpu")]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("attempt", [0, 1, *(pytest.param(n, marks=pytest.mark.slow)
                                              for n in range(2, 8))])
def test_scripts_that_never_close_the_runtime_exit_cleanly(attempt):
    # Left to interpreter teardown, gloo's work objects abort ~1 exit in 6 (SIGABRT, "terminate
    # called without an active exception"); the backend frees them at exit. Several runs, since
    # a single clean exit proves little: 2 in `make test`, 8 with `make conformance`.
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(find_free_port()),
                     worker("no_close.py"))
    assert result.returncode == 0, result.stderr


def test_a_script_runs_as_main_and_its_traceback_starts_in_it(tmp_path, free_port):
    script = tmp_path / "boom.py"
    script.write_text("import sys\n"
                      "assert __name__ == '__main__' and sys.argv[1:] == ['--flag', 'x']\n"
                      "raise ValueError('boom')\n")
    result = run_mpt("launch", "--master-port", str(free_port), str(script), "--flag", "x")
    assert result.returncode == 1
    assert f'File "{script}", line 3, in <module>' in result.stderr
    assert "ValueError: boom" in result.stderr and "AssertionError" not in result.stderr
    assert "runpy" not in result.stderr and "launchers/worker.py" not in result.stderr
    assert "mpt: rank 0 (node 0, local rank 0) exited with code 1" in result.stderr
