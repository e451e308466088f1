"""The horovodrun command mpt builds, and the bad input it refuses (no process is started)."""

from __future__ import annotations

import importlib.util
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
                     "--hosts", "h1,h2", "--horovod-op", "sum", "--dry-run", SCRIPT, "x")
    assert result.returncode == 0, result.stderr
    assert (f"horovodrun -np 4 -H h1:2,h2:2 --gloo python -u -m mpt.launchers.worker {SCRIPT} x"
            in result.stdout)
    assert '"backend": "horovod"' in result.stdout and '"op": "sum"' in result.stdout
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
        assert " no " in line and "mpt install horovod" in result.stdout
    else:
        assert " yes " in line and "gloo" in line


def test_without_horovod_the_backend_is_listed_with_how_to_build_it(monkeypatch):
    from mpt.backends.horovod import HorovodBackend
    from mpt.errors import MissingDependencyError

    for name in ("horovod", "horovod.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without it imports
    info = HorovodBackend.availability()
    assert not info.available and "horovod" in info.reason
    assert "mpt install horovod" in info.install and "HOROVOD_WITH_PYTORCH=1" in info.install
    from mpt import Runtime

    with pytest.raises(MissingDependencyError, match="mpt install horovod"):
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


HOROVOD_BUILT = pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                                   reason="needs horovod (mpt install horovod)")


@HOROVOD_BUILT
@pytest.mark.parametrize("where", [(), ("--nodes", "2", "--gpus", "1", "--hosts", "h1,h2",
                                        "--dry-run")])
def test_adasum_on_a_horovod_without_mpi_is_refused_before_start(run_cli, tmp_path, where):
    """Horovod runs Adasum only over MPI: without it the job failed at its first allreduce
    ("No Adasum operation enabled"); now `mpt launch` says so in one line and starts nothing."""
    import horovod.torch as hvd

    if hvd.mpi_built():
        pytest.skip("this Horovod has MPI, hence Adasum")
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w')\n")
    args = where or ("--gpus", "2", "--master-port", "auto")
    result = run_cli("launch", "--backend", "horovod", *args, "--horovod-op", "adasum",
                     str(script))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("mpt: error: --horovod-op=adasum is invalid: this Horovod "
                                     "was built without MPI")
    assert "Fix: pass --horovod-op average" in result.stderr
    assert not (tmp_path / "started").exists()
    from mpt import Runtime

    with pytest.raises(UsageError, match="built without MPI"):  # a script's own Runtime
        Runtime(backend="horovod", backend_options={"op": "adasum"}, env={})


def test_adasum_over_gloo_is_refused_even_where_horovod_has_mpi(monkeypatch):
    """With MPI built, Adasum still needs MPI at run time: horovodrun --gloo and the gloo join of
    `mpt launch` without --hosts have none."""
    from mpt.backends import horovod
    from mpt.backends.horovod_launch import check_op

    monkeypatch.setattr(horovod, "_check_adasum_built", lambda: None)  # an MPI build
    adasum = spec(nodes=2, backend_options={"op": "adasum"})
    with pytest.raises(UsageError, match=r"--horovod-controller=gloo is invalid: --horovod-op "
                       r"adasum runs only over MPI.*Fix: pass --horovod-controller mpi"):
        horovodrun_command(adasum, [("h1", 1), ("h2", 1)])
    assert "--mpi" in horovodrun_command(adasum, [("h1", 1), ("h2", 1)], controller="mpi")
    with pytest.raises(UsageError, match=r"--horovod-op=adasum is invalid: .* join over gloo"):
        check_op(adasum)
    check_op(spec(nodes=2))


ADASUM_OVER_GLOO = """
import sys
import mpt
import mpt.backends.horovod as backend

backend._check_adasum_built = lambda: None  # passes, as on a Horovod built with MPI
rt = mpt.Runtime(backend_options={"op": "adasum"})
open(sys.argv[1] + f"/rank{rt.rank}", "w")
"""


@HOROVOD_BUILT
@pytest.mark.slow  # 2 processes; the fast cases above refuse before any starts
def test_a_job_that_reaches_horovod_over_gloo_refuses_adasum_before_its_first_allreduce(
        tmp_path):
    script = tmp_path / "train.py"
    script.write_text(ADASUM_OVER_GLOO)
    result = run_mpt("launch", "--backend", "horovod", "--gpus", "2", "--master-port", "auto",
                     str(script), str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr
    assert ("mpt: error: --horovod-op=adasum is invalid: this job's Horovod talks over gloo, and "
            "Horovod runs Adasum only over MPI. Fix: pass --horovod-op average") in result.stderr
    assert not list(tmp_path.glob("rank*"))


@pytest.fixture
def gloo_binds(monkeypatch):
    """Make this machine's host name resolve to the address given (what gloo would bind)."""
    from mpt.backends import horovod_launch

    monkeypatch.setattr(horovod_launch, "own_address", lambda spec: "10.1.0.2")

    def resolve(address: str | None) -> None:
        monkeypatch.setattr(horovod_launch, "gloo_address", lambda: address)
    return resolve


@pytest.mark.parametrize(("address", "refused"), [("127.0.1.1", True), ("127.0.0.1", True),
                                                  ("::1", True), ("10.1.0.2", False),
                                                  (None, False)])
def test_a_host_name_of_loopback_is_refused_for_horovod_across_machines(gloo_binds, address,
                                                                        refused):
    import socket

    from mpt.backends.horovod_launch import check_host_name

    gloo_binds(address)
    across = spec(nodes=2, nr=1, master_addr="node0")
    if not refused:
        check_host_name(across)
        return
    with pytest.raises(UsageError) as info:
        check_host_name(across)
    host = socket.gethostname()
    assert str(info.value) == (
        f"--backend=horovod is invalid: this node's host name {host} resolves to {address}, "
        "which Horovod's gloo binds for its collectives whatever HOROVOD_GLOO_IFACE says, so "
        f"the other nodes cannot reach this one. Fix: map {host} to this node's address in "
        f"/etc/hosts (the line '10.1.0.2 {host}'), or train with --backend ddp or deepspeed (on "
        "CPUs with GLOO_SOCKET_IFNAME naming the node's interface); with every node on this "
        "machine pass --master-addr 127.0.0.1")


@pytest.mark.parametrize(("backend", "nodes", "master_addr"), [
    ("horovod", 1, "node0"),      # one node: loopback is the network
    ("horovod", 2, "127.0.0.1"),  # every node on this machine
    ("horovod", 2, "localhost"),
    ("ddp", 2, "node0"),          # torch's gloo binds the interface GLOO_SOCKET_IFNAME names
])
def test_loopback_serves_one_machine_and_other_backends(gloo_binds, backend, nodes,
                                                        master_addr):
    from mpt.backends import get_backend

    gloo_binds("127.0.0.1")
    get_backend(backend).check_launch(LaunchSpec(script=Path(SCRIPT), nodes=nodes,
                                                 run=RunConfig(backend=backend),
                                                 master_addr=master_addr))


def test_launch_options_reach_the_launcher_parsed_and_select_horovodrun(tmp_path):
    """The backend's launch options, as `mpt launch` hands them over: parsed, with their
    defaults; --hosts or --hostfile hands the job to horovodrun, and only under horovod."""
    from mpt.launchers.horovodrun import describe

    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1 slots=1\nh2 slots=1\n")
    by_file = spec(nodes=2, launch_options={"hostfile": str(hostfile)})
    assert by_file.launch_options == {"hosts": None, "hostfile": hostfile, "controller": "gloo"}
    assert by_file.job_launcher() == "horovodrun"
    assert describe(by_file).endswith(f"horovodrun -np 2 -H h1:1,h2:1 --gloo python -u -m "
                                      f"mpt.launchers.worker {SCRIPT} out 1")
    assert spec(nodes=2).job_launcher() is None  # each node's `mpt launch` starts its own
    ddp = LaunchSpec(script=Path(SCRIPT), launch_options={"controller": "mpi"})
    assert ddp.launch_options == {} and ddp.job_launcher() is None  # nothing to configure
    with pytest.raises(UsageError, match=r"^--hostfile=.* backend 'ddp' is not started by "
                       r"horovodrun\. Fix: use --backend horovod"):
        LaunchSpec(script=Path(SCRIPT), launch_options={"hostfile": str(hostfile)})
