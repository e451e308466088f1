"""The horovodrun command mpt builds, and the bad input it refuses (no process is started)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import run_mpt, worker

from mpt.errors import UsageError
from mpt.launchers import LaunchSpec
from mpt.launchers.horovodrun import horovodrun_command, horovodrun_env, job_hosts, read_hostfile
from mpt.run_config import RunConfig

SCRIPT = worker("report_world.py")


def spec(**kwargs) -> LaunchSpec:
    run = RunConfig(backend="horovod", **{k: kwargs.pop(k) for k in ("precision",
                                                                      "backend_options")
                                          if k in kwargs})
    return LaunchSpec(script=Path(SCRIPT), script_args=("out", "1"), run=run, **kwargs)


def test_two_nodes_of_two_from_hosts():
    s = spec(nodes=2, gpus=2)
    assert horovodrun_command(s, job_hosts(s, "h1,h2", None)) == [
        "horovodrun", "-np", "4", "-H", "h1:2,h2:2", "--gloo",
        "python", "-u", "-m", "mpt.launchers.worker", SCRIPT, "out", "1"]
    assert job_hosts(s, "h1:2,h2:2", None) == [("h1", 2), ("h2", 2)]


def test_hostfile_mpi_fusion_flags_and_settings(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job\nnode-a slots=2\n\nnode-b slots=2  # second\n")
    s = spec(nodes=2, gpus=2, precision="fp16-mixed",
             backend_options={"op": "sum", "cycle_time_ms": 2.5})
    assert read_hostfile(hostfile) == [("node-a", 2), ("node-b", 2)]
    command = horovodrun_command(s, job_hosts(s, None, hostfile), controller="mpi")
    assert command[:6] == ["horovodrun", "-np", "4", "-H", "node-a:2,node-b:2", "--mpi"]
    assert command[6:8] == ["--cycle-time-ms", "2.5"]
    env = horovodrun_env(s)
    run = RunConfig.from_env(env)
    assert run.backend == "horovod" and run.precision == "fp16-mixed"
    # horovodrun turns the cycle time into a HOROVOD_* variable; the rest reaches the backend
    assert run.backend_options == {"op": "sum"}


def test_one_node_on_localhost_gets_gpus_slots():
    s = spec(gpus=3)
    assert horovodrun_command(s, job_hosts(s, "localhost", None))[1:5] == ["-np", "3", "-H",
                                                                           "localhost:3"]


@pytest.mark.parametrize(("hosts", "nodes", "argument"), [
    ("h1,h2,h3", 2, "--hosts"),     # one host too many
    ("h1:4,h2:2", 2, "--hosts"),    # slots differ from --gpus
    ("h1:x", 1, "--hosts"),         # not HOST:SLOTS
    (None, 2, "--hosts"),           # nobody said where
    (None, 1, "--hosts"),           # not even on one node: its `mpt launch` starts its own
])
def test_hosts_that_do_not_match_nodes_and_gpus(hosts, nodes, argument):
    with pytest.raises(UsageError) as info:
        job_hosts(spec(nodes=nodes, gpus=2), hosts, None)
    assert info.value.argument == argument


def test_bad_options_are_usage_errors():
    with pytest.raises(UsageError):
        horovodrun_command(spec(), [("localhost", 1)], controller="nccl")
    with pytest.raises(UsageError):
        job_hosts(spec(nodes=2, nr=1), "h1,h2", None)  # horovodrun runs once, from one place
    with pytest.raises(UsageError, match="restarts nothing"):
        horovodrun_command(spec(max_restarts=2), [("localhost", 1)])
    # mpt writes rank<R>.log itself (mpt.launchers.horovodrun_output), not horovodrun
    assert "--output-filename" not in horovodrun_command(spec(log_dir=Path("logs")),
                                                         [("localhost", 1)])
    with pytest.raises(UsageError, match=r"--zero-stage .* belongs to --backend deepspeed"):
        spec(backend_options={"zero_stage": 2})


def test_cli_dry_run_prints_the_command_and_bad_hosts_exit_2(tmp_path):
    result = run_mpt("launch", "--backend", "horovod", "--nodes", "2", "--gpus", "2",
                     "--hosts", "h1,h2", "--horovod-op", "adasum", "--dry-run", SCRIPT, "x")
    assert result.returncode == 0, result.stderr
    assert (f"horovodrun -np 4 -H h1:2,h2:2 --gloo python -u -m mpt.launchers.worker {SCRIPT} x"
            in result.stdout)
    assert '"backend": "horovod"' in result.stdout and "adasum" in result.stdout
    bad = run_mpt("launch", "--backend", "horovod", "--nodes", "2", "--gpus", "2",
                  "--hosts", "h1:1,h2:1", "--dry-run", SCRIPT)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "--hosts=h1:1,h2:1 is invalid" in bad.stderr
    ddp = run_mpt("launch", "--hosts", "h1", "--dry-run", SCRIPT)
    assert ddp.returncode == 2 and "not started by horovodrun" in ddp.stderr


def test_backends_lists_horovod():
    result = run_mpt("backends")
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if "horovod" in x)
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        assert " no " in line and "make horovod-wheel" in result.stdout
    else:
        assert " yes " in line and "gloo" in line


def test_without_horovod_the_backend_is_listed_with_how_to_build_it(monkeypatch):
    from mpt.backends.horovod import HorovodBackend
    from mpt.errors import MissingDependencyError

    for name in ("horovod", "horovod.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without it imports
    info = HorovodBackend.availability()
    assert not info.available and "horovod" in info.reason
    assert "make horovod-wheel" in info.install and "HOROVOD_WITH_PYTORCH=1" in info.install
    from mpt import Runtime

    with pytest.raises(MissingDependencyError, match="make horovod-wheel"):
        Runtime(backend="horovod", env={})


def test_mpt_horovodrun_reads_horovodruns_arguments_and_runs_the_script_through_the_shim():
    from mpt.launchers.horovodrun_output import read_args, through_worker

    args = ["-np", "4", "-H", "h1:2,h2:2", "--gloo", "python3", "-u", "train.py", "-u", "x"]
    read = read_args(args)
    assert (read.processes, read.per_host, read.command) == (4, 2, 5)
    assert through_worker(args, 5, local_rank_arg=True) == [
        "-np", "4", "-H", "h1:2,h2:2", "--gloo", "python3", "-u", "-m", "mpt.launchers.worker",
        "--local-rank-arg", "train.py", "-u", "x"]
    assert read_args(["-np", "2", "python", "-m", "pkg.train"]).command is None  # not a file
    assert read_args(["--num-proc=3", "bash", "run.sh"]) == type(read)(3, 3, None)
    assert read_args(["-np", "2", "--hostfile", "hosts", "python", "t.py"]).per_host is None


def test_one_report_line_names_the_first_failure_and_what_horovodrun_said():
    from mpt.launchers.horovodrun import HorovodrunResult
    from mpt.launchers.local_rank import LOCAL_RANK_HINT

    assert HorovodrunResult(0).lines() == []
    assert HorovodrunResult(3, "1", "1").lines() == [
        "mpt: rank 1 exited with code 3; the job was stopped"]
    assert HorovodrunResult(3, "1", "0").lines() == [
        "mpt: rank 1 exited with code 3; the job was stopped (horovodrun's report names rank 0, "
        "which stopped after it)"]
    assert HorovodrunResult(2, "0").lines(local_rank_arg=True)[1] == LOCAL_RANK_HINT
    assert "requeue me" in HorovodrunResult(75).lines()[0]


def test_horovodruns_lines_are_sorted_into_rank_logs_and_the_tee_ranks_reach_the_console(
        tmp_path, capsys):
    from mpt.launchers.horovodrun_output import RankOutput

    (tmp_path / "rank0.log").write_text("an earlier job's")
    (tmp_path / "horovodrun.log").write_text("an earlier job's")
    output = RankOutput(tmp_path, frozenset({1}), world_size=2)
    for line in ("[0]<stdout>:zero says\n", "[1]<stderr>:one warns\n",
                 "Mon Nov 23 10:00:00 2026[1]<stdout>:one says\n", "Process 1 exit with 3.\n"):
        output.write(line, sys.stderr)
    output.close()
    assert (tmp_path / "rank0.log").read_text() == "zero says\n"
    assert (tmp_path / "rank1.log").read_text() == "one warns\none says\n"
    assert (tmp_path / "horovodrun.log").read_text() == "Process 1 exit with 3.\n"
    console = capsys.readouterr()
    assert console.out == "[rank1]: one warns\n[rank1]: one says\n" and console.err == ""
    (earlier,) = tmp_path.glob("previous-*")
    assert sorted(p.name for p in earlier.iterdir()) == ["horovodrun.log", "rank0.log"]
