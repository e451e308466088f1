"""`mpt launch --log-dir D [--tee RANKS]`: one file per rank and attempt, tee'd ranks prefixed."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_mpt, worker

from mpt.errors import UsageError
from mpt.launchers.logs import RankLogs, parse_tee


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
    assert f'File "{worker("log_lines.py")}", line 17, in <module>' in rank1
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
