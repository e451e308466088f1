"""`mpt launch --backend horovod --hosts/--hostfile`: build the ``horovodrun`` command for a job
and run it (without those flags, each node's `mpt launch` starts its own processes). The flags
are the backend's ``launch_options``; they reach this module in ``LaunchSpec.launch_options``.

Unlike torchrun's agent, which runs once per node, horovodrun starts every node's processes from
one place (over ssh for remote hosts), so it needs the job's host list: ``--hosts h1,h2`` (each
with ``--gpus`` slots) or a ``--hostfile``. Each process runs mpt's worker shim with mpt's
``MPT_*`` settings in its environment; horovodrun forwards the environment to every host.
Horovod's cycle time is handed to horovodrun as its own flag, which it turns into
``HOROVOD_CYCLE_TIME`` before any worker starts: the only place it takes effect is the
environment ``hvd.init()`` reads (the fusion threshold, ``--bucket-mb``, is exported by the
backend itself, just before ``hvd.init()``, under any launcher).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

import psutil

from mpt._native import bind_to_parent
from mpt.environments.settings import FAILURE_DIR, LOG_FILE
from mpt.errors import MissingDependencyError, UsageError
from mpt.fault import REQUEUE_EXIT_CODE, StallWatch
from mpt.fault.preemption import PREEMPT_SIGNAL
from mpt.launchers.horovodrun_output import (
    RankOutput,
    pump,
    read_args,
    start_pump,
    through_worker,
)
from mpt.launchers.local_rank import LOCAL_RANK_HINT
from mpt.launchers.logs import DEFAULT_TEE, parse_tee
from mpt.launchers.notes import Note
from mpt.launchers.spec import LaunchSpec, thread_env

CONTROLLERS = ("gloo", "mpi")
"""How horovodrun's processes talk: gloo (built here) or MPI (clusters with Open MPI)."""

HOROVODRUN_FLAGS = {"cycle_time_ms": "--cycle-time-ms"}
"""Backend options that are horovodrun flags: Horovod reads them from the environment at init."""

_FIRST_FAILURE = re.compile(r"Process name: (\S+)\s+Exit code: (-?\d+)")


def parse_hosts(hosts: str, gpus: int) -> list[tuple[str, int]]:
    """``"h1,h2"`` or ``"h1:2,h2:2"`` as (host, slots); a host without slots gets ``gpus``."""
    parsed = []
    for item in hosts.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not slots.isdigit()):
            raise UsageError("--hosts", hosts, f"{item!r} is not HOST or HOST:SLOTS",
                             "pass --hosts h1,h2 or --hosts h1:2,h2:2")
        parsed.append((name, int(slots) if slots else gpus))
    return parsed


def read_hostfile(path: Path) -> list[tuple[str, int]]:
    """A horovodrun/Open MPI hostfile (``host slots=N`` lines, ``#`` comments): (host, slots)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UsageError("--hostfile", str(path), f"it cannot be read ({exc.strerror})",
                         "pass a file with one 'HOST slots=N' line per node") from None
    hosts = []
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = [w.removeprefix("slots=") for w in words[1:] if w.startswith("slots=")]
        if len(words) > 2 or (len(words) == 2 and not (slots and slots[0].isdigit())):
            raise UsageError("--hostfile", str(path), f"the line {line.strip()!r} is not "
                             "'HOST slots=N'", "write one 'HOST slots=N' line per node")
        hosts.append((words[0], int(slots[0]) if slots else 1))
    return hosts


def check_hosts(hosts: list[tuple[str, int]], spec: LaunchSpec, argument: str) -> None:
    """The host list must describe exactly ``--nodes`` hosts of ``--gpus`` slots each."""
    shown = ",".join(f"{h}:{s}" for h, s in hosts)
    if len(hosts) != spec.nodes or any(slots != spec.gpus for _, slots in hosts):
        raise UsageError(argument, shown, f"mpt needs {spec.nodes} host(s) with {spec.gpus} "
                         f"slot(s) each for --nodes {spec.nodes} --gpus {spec.gpus}",
                         "list one host per node, each with --gpus slots, or change "
                         "--nodes/--gpus to match")


def job_hosts(spec: LaunchSpec, hosts: str | None, hostfile: Path | None) -> list[tuple[str, int]]:
    """The job's hosts from ``--hosts`` or ``--hostfile``, whichever was given."""
    if hosts and hostfile:
        raise UsageError("--hostfile", str(hostfile), "--hosts is given too",
                         "pass either --hosts or --hostfile")
    if spec.nr != 0:
        raise UsageError("--nr", spec.nr, "with --hosts/--hostfile horovodrun starts every "
                         "node's processes from one place", "run it once, without --nr, or leave "
                         "--hosts/--hostfile out and run `mpt launch --nr R` on every node")
    if hosts:
        parsed, argument = parse_hosts(hosts, spec.gpus), "--hosts"
    elif hostfile is not None:
        parsed, argument = read_hostfile(hostfile), "--hostfile"
    else:
        raise UsageError("--hosts", "<unset>", "horovodrun must know the hosts it starts "
                         "processes on", "pass --hosts h1,h2 or --hostfile FILE")
    check_hosts(parsed, spec, argument)
    return parsed


def horovodrun_command(spec: LaunchSpec, hosts: list[tuple[str, int]],
                       controller: str = "gloo") -> list[str]:
    """The ``horovodrun`` command line that runs ``spec``'s script on ``hosts``."""
    if controller not in CONTROLLERS:
        raise UsageError("--horovod-controller", controller, "unknown controller",
                         f"use one of {', '.join(CONTROLLERS)}")
    if spec.max_restarts:
        raise UsageError("--max-restarts", spec.max_restarts, "horovodrun restarts nothing "
                         "(elastic Horovod needs a host-discovery script)",
                         "pass --max-restarts 0 with --backend horovod")
    if controller == "gloo" and str(spec.run.backend_options.get("op")) == "adasum":
        raise UsageError("--horovod-controller", controller, "--horovod-op adasum runs only "
                         "over MPI, and Horovod's gloo has no Adasum", "pass --horovod-controller "
                         "mpi (a Horovod built with MPI), or --horovod-op average")
    command = ["horovodrun", "-np", str(spec.world.world_size),
               "-H", ",".join(f"{host}:{slots}" for host, slots in hosts), f"--{controller}"]
    for option, flag in HOROVODRUN_FLAGS.items():
        if option in spec.run.backend_options:
            command += [flag, str(spec.run.backend_options[option])]
    return [*command, "python", *spec.worker_args()]


def horovodrun_env(spec: LaunchSpec) -> dict[str, str]:
    """What horovodrun's workers need besides horovodrun's own variables: mpt's settings
    (less the options that became horovodrun flags)."""
    run = spec.run
    options = {k: v for k, v in run.backend_options.items() if k not in HOROVODRUN_FLAGS}
    return replace(spec, run=replace(run, backend_options=options)).worker_env()


def horovodrun_executable() -> str:
    """horovodrun from this interpreter's environment first (a venv need not be on PATH)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("horovodrun", path=path)
    if found is None:
        raise MissingDependencyError("`mpt launch --backend horovod`", "horovod (horovodrun)",
                                     "run `mpt install horovod` (see docs/horovod.md)")
    return found


def _print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _PreemptionRelay:
    """SIGTERM or SIGUSR1 to `mpt launch`: SIGUSR1 to this host's workers, which agree on a step
    with every rank (also those on other hosts), save, and exit with REQUEUE_EXIT_CODE;
    horovodrun is stopped if they have not finished within the grace period."""

    def __init__(self, process: subprocess.Popen[str], grace_period: float) -> None:
        self.received = ""
        self._process, self._grace_period = process, grace_period
        self._previous = {sig: signal.signal(sig, self._on_signal)
                          for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            return
        self.received = signal.Signals(signum).name
        for child in psutil.Process(self._process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):  # it may have exited meanwhile
                if "mpt.launchers.worker" in child.cmdline():
                    child.send_signal(PREEMPT_SIGNAL)
        timer = threading.Timer(self._grace_period, self._process.terminate)
        timer.daemon = True
        timer.start()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True, slots=True)
class HorovodrunResult:
    """How a horovodrun job ended, as `mpt launch` reports it."""

    code: int
    """horovodrun's exit code, the failed rank's, or REQUEUE_EXIT_CODE after a clean preemption."""
    rank: str = ""
    """The rank that failed first ("" when none did or nobody said)."""
    named_by_horovodrun: str = ""
    """The process horovodrun's own report names, often a peer that failed after ``rank``."""

    def lines(self, local_rank_arg: bool = False) -> list[str]:
        """What `mpt launch` and `mpt horovodrun` print about it (nothing for a clean exit)."""
        if self.code == REQUEUE_EXIT_CODE:
            return [f"mpt: preempted: the ranks saved and exited {self.code} (requeue me)"]
        if not self.code:
            return []
        who = f"rank {self.rank} " if self.rank else "horovodrun "
        line = f"mpt: {who}exited with code {self.code}; the job was stopped"
        if self.named_by_horovodrun not in ("", self.rank):
            line += (f" (horovodrun's report names rank {self.named_by_horovodrun}, which "
                     "stopped after it)")
        return [line, *([LOCAL_RANK_HINT] if local_rank_arg and self.code == 2 else [])]


def run_horovodrun(args: Sequence[str], env: dict[str, str], grace_period: float = 30,
                   heartbeat_timeout: float = 0,
                   output: RankOutput | None = None) -> HorovodrunResult:
    """Run horovodrun with ``args``, ``env`` added; how it ended.

    horovodrun itself exits 1 whatever a rank's code was. The rank that failed first is taken
    from the failure notes of ``mpt.launchers.worker`` (``worker.Note``) where they were
    written on this host, else from horovodrun's last words on stderr ("Process name: 1 Exit
    code: 3"). Preempted (SIGTERM or SIGUSR1) with every rank of this host saved, the code is
    REQUEUE_EXIT_CODE. ``output`` places the ranks' lines (default: as horovodrun writes them).
    """
    launcher = os.getpid()
    output = output or RankOutput(None)
    if output.log_dir is not None:  # the workers merge stderr into stdout: one ordered stream
        env = {**env, LOG_FILE: str(output.log_dir)}

    def die_with_us() -> None:  # in the child, before exec
        # A SIGKILLed `mpt launch` runs no cleanup; horovodrun stops its workers on SIGTERM.
        if not bind_to_parent(signal.SIGTERM, launcher):
            os._exit(1)

    with tempfile.TemporaryDirectory(prefix="mpt-failures-") as failure_dir:
        process = subprocess.Popen([horovodrun_executable(), *args],
                                   env={**os.environ, **env, FAILURE_DIR: failure_dir},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   bufsize=1, preexec_fn=die_with_us)  # before our threads
        tail: list[str] = []
        preemption = _PreemptionRelay(process, grace_period)
        watch = StallWatch(failure_dir, heartbeat_timeout, report=_print_err)
        assert process.stdout is not None and process.stderr is not None
        relay = start_pump(process.stdout, output, sys.stdout)
        try:
            pump(process.stderr, output, sys.stderr, tail)
            code = process.wait()
        finally:
            preemption.restore()
            watch.stop()
            if process.poll() is None:  # interrupted: horovodrun stops its workers itself
                process.terminate()
                process.wait()
            relay.join(timeout=5)
            output.close()
        notes = sorted(n for n in Note.read_all(failure_dir).values() if n.exit_code)
    if preemption.received and notes and all(n.exit_code == REQUEUE_EXIT_CODE for n in notes):
        return HorovodrunResult(REQUEUE_EXIT_CODE)
    found = _FIRST_FAILURE.search("".join(tail))
    named = found.group(1) if found and code else ""
    if code and notes and notes[0].rank >= 0:
        # horovodrun names the first process it saw exit, often a peer that failed because
        # the real culprit was already shutting Horovod down; the workers' notes (on this
        # host) say who failed first, and with which code.
        return HorovodrunResult(notes[0].exit_code, str(notes[0].rank), named)
    if code == 0 or found is None:
        return HorovodrunResult(code)
    rank_code = int(found.group(2))
    # A signal shows as a negative code; the shell's convention is 128 + signal.
    return HorovodrunResult(128 - rank_code if rank_code < 0 else rank_code or code, named, named)


def job_command(spec: LaunchSpec) -> list[str]:
    """The horovodrun command of ``spec``'s launch options (``--hosts`` or ``--hostfile``,
    ``--horovod-controller``; see ``HorovodBackend.launch_options``)."""
    options = spec.launch_options
    hosts = job_hosts(spec, options.get("hosts"), options.get("hostfile"))
    return horovodrun_command(spec, hosts, options.get("controller") or "gloo")


def describe(spec: LaunchSpec) -> str:
    """What `mpt launch --dry-run` prints: the workers' settings and the horovodrun command."""
    settings = " ".join(f"{k}={shlex.quote(v)}" for k, v in horovodrun_env(spec).items())
    return f"{settings} {shlex.join(job_command(spec))}"


def run(spec: LaunchSpec) -> tuple[int, list[str]]:
    """Run the whole job through horovodrun: its exit code (as ``run_horovodrun``) and what
    `mpt launch` prints about it."""
    args = job_command(spec)[1:]
    args[args.index("python")] = sys.executable  # the printed "python" is this interpreter
    output = RankOutput(spec.log_dir, spec.tee, spec.world.world_size)
    result = run_horovodrun(args, horovodrun_env(spec), spec.grace_period,
                            spec.heartbeat_timeout, output)
    return result.code, result.lines(spec.local_rank_arg)


def run_passthrough(args: Sequence[str], settings: dict[str, str], *,
                    log_dir: Path | None = None, tee: str | None = None,
                    local_rank_arg: bool = False) -> HorovodrunResult:
    """`mpt horovodrun ARGS`: horovodrun as the user wrote it, with what `mpt launch --backend
    horovod` gives its workers: ``settings``, one OpenMP thread per process where a host runs
    several, the worker shim (failure notes, ``--local_rank``), per-rank logs and tee."""
    read = read_args(args)
    if read.command is not None:
        args = through_worker(args, read.command, local_rank_arg)
    elif local_rank_arg:
        raise UsageError("--local-rank-arg", True, "horovodrun's command is not `python SCRIPT "
                         "...`, so mpt cannot pass --local_rank to it", "start the script as "
                         "`python train.py ...`, or leave --local-rank-arg out")
    ranks = DEFAULT_TEE
    if tee is not None:
        if log_dir is None:
            raise UsageError("--tee", tee, "it needs --log-dir (without it every rank prints "
                             "to the console)", "add --log-dir DIR, or leave --tee out")
        if read.processes is None:
            raise UsageError("--tee", tee, "horovodrun's -np is not given, so the ranks are "
                             "unknown", "pass -np N to horovodrun")
        ranks = parse_tee(tee, read.processes)
    output = RankOutput(log_dir, ranks, read.processes)
    return run_horovodrun(args, {**settings, **thread_env(read.per_host)}, output=output)
