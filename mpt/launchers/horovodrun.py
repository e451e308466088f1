"""`mpt launch --backend horovod`: build the ``horovodrun`` command for a job and run it.

Unlike torchrun's agent, which runs once per node, horovodrun starts every node's processes from
one place (over ssh for remote hosts), so it needs the job's host list: ``--hosts h1,h2`` (each
with ``--gpus`` slots) or a ``--hostfile``. Each process runs mpt's worker shim with mpt's
``MPT_*`` settings in its environment; horovodrun forwards the environment to every host.
Horovod's fusion threshold and cycle time are handed to horovodrun as its own flags, which it
turns into ``HOROVOD_FUSION_THRESHOLD``/``HOROVOD_CYCLE_TIME`` before any worker starts: the
only place they take effect is the environment ``hvd.init()`` reads.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

import psutil

from mpt._native import bind_to_parent
from mpt.environments.settings import FAILURE_DIR
from mpt.errors import MissingDependencyError, UsageError
from mpt.fault import REQUEUE_EXIT_CODE, StallWatch
from mpt.fault.preemption import PREEMPT_SIGNAL
from mpt.launchers.notes import Note
from mpt.launchers.spec import LaunchSpec

CONTROLLERS = ("gloo", "mpi")
"""How horovodrun's processes talk: gloo (built here) or MPI (clusters with Open MPI)."""

HOROVODRUN_FLAGS = {"fusion_threshold_mb": "--fusion-threshold-mb",
                    "cycle_time_ms": "--cycle-time-ms"}
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
    """The job's hosts from ``--hosts`` or ``--hostfile``; ``localhost:G`` on a single node."""
    if hosts and hostfile:
        raise UsageError("--hostfile", str(hostfile), "--hosts is given too",
                         "pass either --hosts or --hostfile")
    if spec.nr != 0:
        raise UsageError("--nr", spec.nr, "horovodrun starts every node's processes from one "
                         "place", "run `mpt launch --backend horovod` once, without --nr")
    if hosts:
        parsed, argument = parse_hosts(hosts, spec.gpus), "--hosts"
    elif hostfile:
        parsed, argument = read_hostfile(hostfile), "--hostfile"
    elif spec.nodes == 1:
        parsed, argument = [("localhost", spec.gpus)], "--gpus"
    else:
        raise UsageError("--hosts", "<unset>", f"horovodrun must know the {spec.nodes} hosts "
                         "it starts processes on", "pass --hosts h1,h2 or --hostfile FILE")
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
    command = ["horovodrun", "-np", str(spec.world.world_size),
               "-H", ",".join(f"{host}:{slots}" for host, slots in hosts), f"--{controller}"]
    if spec.log_dir:  # one folder per rank, like torchrun's log files
        command += ["--output-filename", str(spec.log_dir)]
    for option, flag in HOROVODRUN_FLAGS.items():
        if option in spec.backend_options:
            command += [flag, str(spec.backend_options[option])]
    return [*command, "python", "-u", "-m", "mpt.launchers.worker", str(spec.script),
            *spec.script_args]


def horovodrun_env(spec: LaunchSpec) -> dict[str, str]:
    """What horovodrun's workers need besides horovodrun's own variables: mpt's settings
    (less the options that became horovodrun flags)."""
    options = {k: v for k, v in spec.backend_options.items() if k not in HOROVODRUN_FLAGS}
    return replace(spec, backend_options=options).worker_env()


def horovodrun_executable() -> str:
    """horovodrun from this interpreter's environment first (a venv need not be on PATH)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("horovodrun", path=path)
    if found is None:
        raise MissingDependencyError("`mpt launch --backend horovod`", "horovod (horovodrun)",
                                     "run `make horovod-wheel` and pip install the wheel "
                                     "it leaves in .cache/wheels (see docs/horovod.md)")
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


def run_horovodrun(args: Sequence[str], env: dict[str, str], grace_period: float = 30,
                   heartbeat_timeout: float = 0) -> tuple[int, str]:
    """Run horovodrun with ``args``, ``env`` added; its exit code, or the failed rank's.

    horovodrun itself exits 1 whatever a rank's code was. The rank that failed first is taken
    from the failure notes of ``mpt.launchers.worker`` (``worker.Note``) where they were
    written on this host, else from horovodrun's last words on stderr ("Process name: 1 Exit
    code: 3"), which it passes through line by line. Returns
    ``(code, rank)``; ``rank`` is "" when no rank failed or horovodrun did not say. Preempted
    (SIGTERM or SIGUSR1) with every rank of this host saved, the code is REQUEUE_EXIT_CODE.
    """
    launcher = os.getpid()

    def die_with_us() -> None:  # in the child, before exec
        # A SIGKILLed `mpt launch` runs no cleanup; horovodrun stops its workers on SIGTERM.
        if not bind_to_parent(signal.SIGTERM, launcher):
            os._exit(1)

    with tempfile.TemporaryDirectory(prefix="mpt-failures-") as failure_dir:
        process = subprocess.Popen([horovodrun_executable(), *args],
                                   env={**os.environ, **env, FAILURE_DIR: failure_dir},
                                   stderr=subprocess.PIPE, text=True, bufsize=1,
                                   preexec_fn=die_with_us)  # before our reader thread: fork-safe
        tail: list[str] = []
        preemption = _PreemptionRelay(process, grace_period)
        watch = StallWatch(failure_dir, heartbeat_timeout, report=_print_err)
        try:
            assert process.stderr is not None
            for line in process.stderr:
                sys.stderr.write(line)
                tail = [*tail[-20:], line]
            code = process.wait()
        finally:
            preemption.restore()
            watch.stop()
            if process.poll() is None:  # interrupted: horovodrun stops its workers itself
                process.terminate()
                process.wait()
        notes = sorted(n for n in Note.read_all(failure_dir).values() if n.exit_code)
    if preemption.received and notes and all(n.exit_code == REQUEUE_EXIT_CODE for n in notes):
        return REQUEUE_EXIT_CODE, ""
    if code and notes and notes[0].rank >= 0:
        # horovodrun names the first process it saw exit, often a peer that failed because
        # the real culprit was already shutting Horovod down; the workers' notes (on this
        # host) say who failed first, and with which code.
        return notes[0].exit_code, str(notes[0].rank)
    found = _FIRST_FAILURE.search("".join(tail))
    if code == 0 or found is None:
        return code, ""
    rank_code = int(found.group(2))
    # A signal shows as a negative code; the shell's convention is 128 + signal.
    return (128 - rank_code if rank_code < 0 else rank_code or code), found.group(1)


def run(spec: LaunchSpec, hosts: list[tuple[str, int]],
        controller: str = "gloo") -> tuple[int, str]:
    """Run the whole job through horovodrun; ``(exit code, failed rank)`` as run_horovodrun."""
    args = horovodrun_command(spec, hosts, controller)[1:]
    args[args.index("python")] = sys.executable  # the printed "python" is this interpreter
    return run_horovodrun(args, horovodrun_env(spec), spec.grace_period, spec.heartbeat_timeout)
