"""`mpt launch --log-dir D [--tee RANKS]`: one file per rank and attempt, tee'd ranks prefixed;
without ``--log-dir``, every rank on the console in whole lines, prefixed where there are
several."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from conftest import run_mpt, worker

from mpt.errors import UsageError
from mpt.launchers.logs import ConsoleLogs, ConsoleTail, RankLogs, console_lines, parse_tee
from mpt.launchers.worker import PREFIXED

RAISE_LINE = next(n for n, line in enumerate(Path(worker("log_lines.py")).read_text().splitlines(),
                                              start=1) if line.lstrip().startswith("raise "))
"""Where log_lines.py raises, as a traceback names it."""


def agent_envs(ranks: list[int], world_size: int, node: int, restart: int = 0
               ) -> dict[int, dict[str, str]]:
    """What torch's agent hands ``reify``: one environment per local rank (the keys it reads)."""
    return {local: {"RANK": str(rank), "WORLD_SIZE": str(world_size), "GROUP_RANK": str(node),
                    "TORCHELASTIC_RESTART_COUNT": str(restart)}
            for local, rank in enumerate(ranks)}


def test_tee_takes_ranks_of_the_world_or_all():
    assert parse_tee("0,1", 4) == {0, 1} and parse_tee(" 3 ", 4) == {3}
    assert parse_tee("all", 3) == {0, 1, 2}
    with pytest.raises(UsageError, match=r"^--tee=2 is invalid: the job has ranks 0\.\.1 only"):
        parse_tee("2", 2)
    with pytest.raises(UsageError, match=r"^--tee=one is invalid: it is not a list of ranks"):
        parse_tee("one", 2)
    with pytest.raises(UsageError, match=r"it names no rank"):
        parse_tee(",", 2)


def test_files_are_named_by_global_rank_and_attempt_and_earlier_logs_move_aside(tmp_path):
    logs = tmp_path / "logs"
    (logs / ".errors").mkdir(parents=True)
    earlier = {"rank0.log": "node 0's", "rank2.log": "old 2", "rank3.restart1.log": "old 3",
               "rank5.log": "beyond the new world", ".errors/rank2.restart0.json": "{}",
               "notes.txt": "not a log"}
    for name, text in earlier.items():
        (logs / name).write_text(text)
    spec = RankLogs(logs, tee=frozenset({3}))

    envs = agent_envs([2, 3], world_size=4, node=1)  # node 1 of a 2 x 2 job
    dest = spec.reify(envs)
    assert dest.stdouts == {0: str(logs / "rank2.log"), 1: str(logs / "rank3.log")}
    assert dest.stderrs == {0: "", 1: ""}  # the worker merges stderr into the file itself
    assert dest.tee_stdouts == {1: str(logs / "rank3.log")} and not dest.tee_stderrs
    assert [env["MPT_LOG_FILE"] for env in envs.values()] == list(dest.stdouts.values())
    assert envs[0]["TORCHELASTIC_ERROR_FILE"] == dest.error_files[0] == str(
        logs / ".errors" / "rank2.restart0.json")
    # Node 1 moved its own ranks' files only: node 0 may already be writing rank0.log.
    [previous] = logs.glob("previous-*")
    assert (previous / "rank2.log").read_text() == "old 2"
    assert (previous / "rank3.restart1.log").read_text() == "old 3"
    assert (previous / ".errors" / "rank2.restart0.json").exists()
    assert {p.name for p in logs.iterdir()} == {"rank0.log", "rank5.log", "notes.txt", ".errors",
                                                previous.name}

    (logs / "rank2.log").write_text("attempt 0")
    restarted = spec.reify(agent_envs([2, 3], world_size=4, node=1, restart=1))
    assert restarted.stdouts[0] == str(logs / "rank2.restart1.log")
    assert restarted.error_files[0] == str(logs / ".errors" / "rank2.restart1.json")
    assert (logs / "rank2.log").read_text() == "attempt 0", "a restart moved the first attempt"

    # Node 0 also moves the files of ranks the new job does not have; nothing is overwritten.
    RankLogs(logs).reify(agent_envs([0, 1], world_size=4, node=0))
    moved = {p.relative_to(logs).as_posix() for p in logs.glob("previous-*/**/*") if p.is_file()}
    assert {"rank0.log", "rank5.log"} <= {Path(m).name for m in moved} and len(moved) == 5
    assert not (logs / "rank0.log").exists() and (logs / "rank2.log").exists()


def test_a_log_dir_that_is_a_file_is_refused(tmp_path, free_port):
    with pytest.raises(UsageError, match=r"^--log-dir=.* is invalid: it is a file"):
        RankLogs(Path(__file__))
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--log-dir",
                     __file__, worker("report_world.py"), str(tmp_path))
    assert result.returncode == 2
    assert f"mpt: error: --log-dir={__file__} is invalid: it is a file." in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_tee_is_one_usage_error(run_cli, tmp_path):
    script = worker("report_world.py")
    result = run_cli("launch", "--gpus", "2", "--log-dir", str(tmp_path), "--tee", "0,2", script)
    assert result.returncode == 2
    assert "mpt: error: --tee=0,2 is invalid: the job has ranks 0..1 only" in result.stderr
    result = run_cli("launch", "--gpus", "2", "--tee", "all", script)
    assert result.returncode == 2 and "--tee=all is invalid: it needs --log-dir" in result.stderr


def test_each_rank_logs_to_its_own_file_in_order_and_only_rank0_reaches_the_console(
        tmp_path, free_port):
    logs = tmp_path / "logs"
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--log-dir",
                     str(logs), worker("log_lines.py"), "1")
    assert result.returncode == 1, result.stderr
    assert "mpt: rank 1 (node 0, local rank 1) exited with code 1" in result.stderr
    assert sorted(p.name for p in logs.glob("rank*")) == ["rank0.log", "rank1.log"]
    for rank in range(2):
        text = (logs / f"rank{rank}.log").read_text()
        lines = [f"out 1 from rank {rank}", f"err 2 from rank {rank}", f"out 3 from rank {rank}"]
        assert text.startswith("\n".join(lines) + "\n"), text  # stdout and stderr, in order
    # The failed rank's whole traceback is in its file, after its lines, starting in the script.
    rank1 = (logs / "rank1.log").read_text()
    assert rank1.index("Traceback (most recent call last):") > rank1.index("out 3 from rank 1")
    assert f'File "{worker("log_lines.py")}", line {RAISE_LINE}, in <module>' in rank1
    assert "[rank1]" not in rank1  # torch's own rank prefix: the file is rank 1's alone
    assert rank1.rstrip().endswith("ValueError: rank 1 fails on purpose")
    # Rank 0 on the console, every line with its prefix; rank 1 nowhere on the console.
    for line in ("out 1", "err 2", "out 3"):
        assert f"[rank0]: {line} from rank 0\n" in result.stdout
    console = result.stdout + result.stderr
    assert "from rank 1" not in console and "fails on purpose" not in console


def test_restarts_keep_each_attempt_and_a_new_job_moves_the_old_logs_aside(tmp_path, free_port):
    logs = tmp_path / "logs"
    first = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--log-dir",
                    str(logs), worker("report_world.py"), str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert "[rank0]: report from rank 0" in first.stdout and "from rank 1" not in first.stdout
    for rank in range(2):
        assert f"report from rank {rank}" in (logs / f"rank{rank}.log").read_text()

    second = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--log-dir",
                     str(logs), "--tee", "all", "--max-restarts", "1", worker("fail_once.py"),
                     str(tmp_path))
    assert second.returncode == 0, second.stderr
    # The first job's files, moved aside whole.
    [previous] = logs.glob("previous-*")
    for rank in range(2):
        assert f"report from rank {rank}" in (previous / f"rank{rank}.log").read_text()
    # One file per rank and attempt; the failed first attempt keeps its traceback.
    assert sorted(p.name for p in logs.glob("rank*")) == [
        "rank0.log", "rank0.restart1.log", "rank1.log", "rank1.restart1.log"]
    rank1 = (logs / "rank1.log").read_text()
    assert rank1.startswith("attempt 0 of rank 1\n") and "Traceback" in rank1
    assert rank1.rstrip().endswith("RuntimeError: rank 1 fails on the first attempt")
    assert (logs / "rank1.restart1.log").read_text() == "attempt 1 of rank 1\n"
    # --tee all: both ranks on the console, each line with its own global rank.
    for attempt in range(2):
        for rank in range(2):
            assert f"[rank{rank}]: attempt {attempt} of rank {rank}\n" in second.stdout
    assert "[rank1]: RuntimeError: rank 1 fails on the first attempt" in second.stdout


def test_console_files_are_kept_per_rank_and_attempt_for_several_ranks_only(tmp_path):
    spec = ConsoleLogs(tmp_path)
    envs = agent_envs([2, 3], world_size=4, node=1, restart=1)
    dest = spec.reify(envs)
    attempt = tmp_path / "restart1"
    assert dest.stdouts == dest.tee_stdouts == {0: str(attempt / "rank2.out"),
                                                1: str(attempt / "rank3.out")}
    assert dest.stderrs == dest.tee_stderrs == {0: str(attempt / "rank2.err"),
                                                1: str(attempt / "rank3.err")}
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == dest.error_files[1] == str(attempt / "rank3.json")
    assert all(env[PREFIXED] == "1" for env in envs.values())
    # One rank: the console as it is, unprefixed; torch still gets its error file.
    alone = agent_envs([0], world_size=1, node=0)
    dest = spec.reify(alone)
    assert dest.stdouts == dest.stderrs == {0: ""} and not dest.tee_stdouts | dest.tee_stderrs
    assert PREFIXED not in alone[0] and dest.error_files[0].endswith("rank0.json")


def test_inside_console_lines_the_tail_is_mpts_own_and_torchs_tails_nothing(tmp_path):
    with console_lines() as tail:
        dest = ConsoleLogs(tmp_path).reify(agent_envs([0, 1], world_size=2, node=0))
        assert not dest.tee_stdouts and not dest.tee_stderrs
        assert dest.stdouts[1] == str(tmp_path / "restart0" / "rank1.out")
        assert sorted((f.path, f.prefix, f.stream) for f in tail._files) == sorted(
            (str(tmp_path / "restart0" / f"rank{r}.{ext}"), f"[rank{r}]: ", stream)
            for r in range(2) for ext, stream in (("out", "stdout"), ("err", "stderr")))


def test_the_tail_writes_whole_lines_only_and_the_rest_when_it_stops(tmp_path, capsys):
    out, err = tmp_path / "rank0.out", tmp_path / "rank1.err"
    tail = ConsoleTail()
    tail.add(str(out), "[rank0]: ", "stdout")
    tail.add(str(err), "[rank1]: ", "stderr")  # not there yet: read once it is
    with out.open("wb", buffering=0) as rank0, err.open("wb", buffering=0) as rank1:
        rank0.write(b"one\n\ntw")
        rank1.write(b"x" * ConsoleTail.LONGEST)  # no newline, but too long to hold
        assert wait_for_output(capsys, "[rank0]: one\n[rank0]: \n", "[rank1]: ")
        rank0.write(b"o, half")
        rank1.write("\u00e9 no newline at the end".encode())
        time.sleep(5 * ConsoleTail.POLL_S)
        assert capsys.readouterr() == ("", "")  # nothing whole since
    tail.stop()
    assert capsys.readouterr() == ("[rank0]: two, half\n",
                                   "[rank1]: \u00e9 no newline at the end\n")


def wait_for_output(capsys, out: str, err_start: str) -> bool:
    """Whether the tail wrote ``out`` on stdout and a line starting ``err_start`` on stderr."""
    got_out, got_err = "", ""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (got_out == out and got_err):
        time.sleep(ConsoleTail.POLL_S)
        new = capsys.readouterr()
        got_out, got_err = got_out + new.out, got_err + new.err
    return got_out == out and got_err.startswith(err_start) and got_err.endswith("x\n")


def test_console_files_go_to_the_launch_folder_and_without_one_the_console_stays(
        tmp_path, monkeypatch):
    monkeypatch.setenv("MPT_FAILURE_DIR", str(tmp_path))
    dest = ConsoleLogs().reify(agent_envs([0, 1], world_size=2, node=0))
    assert dest.tee_stdouts[1] == str(tmp_path / "console" / "restart0" / "rank1.out")
    monkeypatch.delenv("MPT_FAILURE_DIR")
    envs = agent_envs([0, 1], world_size=2, node=0)
    dest = ConsoleLogs().reify(envs)
    assert dest.stdouts == {0: "", 1: ""} and not dest.tee_stdouts
    assert dest.error_files == {0: os.devnull, 1: os.devnull}
    assert envs[0]["TORCHELASTIC_ERROR_FILE"] == ""


OUT_LINE = re.compile(r"\[rank([01])\]: (out [13] from rank \1|line \d+ of rank \1 in "
                      r"(pieces|two prints))")
ERR_LINE = re.compile(r"\[rank([01])\]: err \d+ (from|of) rank \1")


def test_without_a_log_dir_every_line_is_whole_and_names_its_rank(free_port):
    """Two ranks print many lines in pieces (several words a print, a line in two prints) on
    stdout and stderr: each reaches the console whole, once, in order, after its rank."""
    rounds = 150
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port),
                     worker("log_lines.py"), "--many", str(rounds))
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert [line for line in out if not OUT_LINE.fullmatch(line)] == []
    for rank in range(2):
        mine = [line for line in out if line.startswith(f"[rank{rank}]: ")]
        assert len(mine) == 2 + 2 * rounds
        numbers = [int(line.split()[2]) for line in mine if " in pieces" in line]
        assert numbers == list(range(rounds))  # in the order the rank wrote them
    err = result.stderr.splitlines()
    assert err[0].startswith("mpt: no CUDA device here")  # the launcher's own: no prefix
    assert [line for line in err[1:] if not ERR_LINE.fullmatch(line)] == []
    assert len(err) == 1 + 2 * (1 + rounds)


def test_without_a_log_dir_a_traceback_is_prefixed_once_and_one_rank_is_not_prefixed(
        tmp_path, free_port):
    failed = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port),
                     worker("log_lines.py"), "1")
    assert failed.returncode == 1, failed.stderr
    assert "[rank1]: Traceback (most recent call last):\n" in failed.stderr
    assert "[rank1]: ValueError: rank 1 fails on purpose\n" in failed.stderr
    assert "[rank1]: [rank1]" not in failed.stderr  # torch's excepthook adds none of its own
    # The traceback comes before the summary, which the launcher writes unprefixed, last.
    assert failed.stderr.rstrip().splitlines()[-1] == (
        "mpt: rank 1 (node 0, local rank 1) exited with code 1; the job was stopped")
    alone = run_mpt("launch", "--gpus", "1", "--master-port", str(free_port),
                    worker("log_lines.py"))
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout == "out 1 from rank 0\nout 3 from rank 0\n"
    assert "\nerr 2 from rank 0\n" in alone.stderr and "[rank" not in alone.stderr


def test_without_a_log_dir_a_restarted_gang_keeps_its_prefixes(tmp_path, free_port):
    result = run_mpt("launch", "--gpus", "2", "--master-port", str(free_port), "--max-restarts",
                     "1", worker("fail_once.py"), str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == sorted(
        f"[rank{rank}]: attempt {attempt} of rank {rank}" for attempt in range(2)
        for rank in range(2))
    assert "[rank1]: RuntimeError: rank 1 fails on the first attempt\n" in result.stderr
