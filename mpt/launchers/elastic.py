"""Start this node's processes through torch.distributed.run's machinery and supervise them.

torchrun's elastic agent already does what a hand-written Popen loop gets wrong: it sets each
worker's RANK/LOCAL_RANK/WORLD_SIZE, hosts the rendezvous store on node 0, watches the workers,
and when one fails it stops the others (SIGTERM, then SIGKILL after a grace period). mpt builds
its ``LaunchConfig`` with a static rendezvous (node ranks fixed by ``--nr``) and hands off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from mpt.elastic import ELASTIC_AGENT_ENV, below_min, rendezvous_configs
from mpt.environments.settings import FAILURE_DIR, LAUNCHER_PID
from mpt.fault import REQUEUE_EXIT_CODE, Beat, StallWatch, read_beats, suspects
from mpt.fault.heartbeat import WAITING_PHASES
from mpt.fault.link import RendezvousWatch
from mpt.fault.preemption import PREEMPT_SIGNAL
from mpt.launchers.horovod_join import HorovodRendezvous
from mpt.launchers.local_rank import LOCAL_RANK_HINT
from mpt.launchers.logs import LOG_LINE_PREFIX, rank_logs
from mpt.launchers.notes import Note, read_error, unapplied_flags
from mpt.launchers.spec import LaunchSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    """The first rank that failed, as the launcher reports it."""

    rank: int
    """Global rank of the failed process."""
    local_rank: int
    """Its rank on its node."""
    exit_code: int
    """Its exit code, or 128 + signal number when a signal killed it (the shell's rule)."""
    signal: str = ""
    """The signal's name when a signal killed it."""


def torch_launch_config(spec: LaunchSpec) -> LaunchConfig:
    """The torchrun ``LaunchConfig`` equivalent of ``spec``: a static rendezvous (ranks from
    ``--nr``), or for ``--nodes MIN:MAX`` torch's c10d one, whose store the first node to bind
    ``--master-port`` at ``--master-addr`` hosts (see mpt.elastic)."""
    logs = rank_logs(spec.log_dir, spec.tee)
    static = not spec.elastic
    # Newer torch's knobs, given where this torch has them (2.11 has neither): the grace
    # period before SIGKILL, and signals left to mpt's own handlers.
    newer = {"shutdown_timeout": spec.grace_period,
             # SIGTERM and SIGUSR1 are mpt's own (PreemptionRelay): they preempt, not kill.
             "signals_to_handle": "SIGINT,SIGHUP,SIGQUIT"}
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    return LaunchConfig(
        min_nodes=spec.node_range.min,
        max_nodes=spec.nodes,
        nproc_per_node=spec.gpus,
        run_id=f"mpt-{spec.master_port}",
        rdzv_backend="static" if static else "c10d",
        rdzv_endpoint=f"{spec.master_addr}:{spec.master_port}",
        rdzv_configs={"rank": spec.nr, "timeout": spec.rdzv_timeout} if static
        else rendezvous_configs(spec.rdzv_timeout),
        local_addr=None if static else spec.local_addr,
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=logs,
        log_line_prefix_template=LOG_LINE_PREFIX,
        **{name: value for name, value in newer.items() if name in known},
    )


def worker_env(spec: LaunchSpec, failure_dir: str) -> dict[str, str]:
    """Variables the workers inherit: the spec's settings, and the launcher's own two."""
    env = spec.worker_env()
    env[LAUNCHER_PID] = str(os.getpid())  # workers bind their lives to ours (see Runtime)
    env[FAILURE_DIR] = failure_dir  # where they note when they failed (see root_cause)
    return env


@contextlib.contextmanager
def snapshot_store(spec: LaunchSpec) -> Iterator[LaunchSpec]:
    """``spec`` with, under ``--snapshot-every`` without ``--snapshot-dir``, a store for this
    node's snapshots in memory (/dev/shm) that lives as long as this launch: the workers a
    restart replaces find it, and it is removed on every way out."""
    if not spec.run.snapshot_every or spec.run.snapshot_dir is not None:
        yield spec
        return
    memory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="mpt-snapshots-", dir=memory) as store:
        yield dataclasses.replace(spec, run=spec.run.replace(snapshot_dir=store))


def root_cause(failures: dict[int, ProcessFailure], notes: dict[int, Note]) -> Failure:
    """The rank whose failure brought the job down.

    torch's own choice (``get_first_failure``) compares timestamps in whole seconds and also
    lists the ranks the agent stopped itself, so it often names a victim. Here, in order:
    a rank that died without a note (a crash signal, the OOM killer's SIGKILL, ``os._exit``);
    then the rank whose note (by pid) is earliest; last, ranks ended by SIGTERM, which is what
    the agent sends the survivors.
    """

    def order(item: tuple[int, ProcessFailure]) -> tuple[int, float]:
        failure = item[1]
        if failure.pid in notes:
            return 1, notes[failure.pid].failed_at
        if failure.exitcode == -signal.SIGTERM:
            return 2, failure.timestamp
        return 0, failure.timestamp

    notes = {pid: note for pid, note in notes.items() if note.exit_code}  # not clean exits
    rank, failure = min(failures.items(), key=order)
    if failure.pid in notes:
        # The script's own code: the agent's SIGTERM may still catch the rank on its way out
        # (in atexit handlers) once a peer has failed in turn, and replace the code it exits with.
        return Failure(rank=rank, local_rank=failure.local_rank,
                       exit_code=notes[failure.pid].exit_code)
    code = failure.exitcode
    return Failure(rank=rank, local_rank=failure.local_rank,
                   exit_code=128 - code if code < 0 else code,
                   signal=failure.signal_name() if code < 0 else "")


@dataclass(frozen=True, slots=True)
class Outcome:
    """How this node's share of the job ended: the code `mpt launch` exits with, and why."""

    exit_code: int
    """0, the failed rank's code, REQUEUE_EXIT_CODE after a clean preemption, or 128+signal."""
    lines: tuple[str, ...] = ()
    """What `mpt launch` prints about it, one finding per line."""


class PreemptionRelay:
    """SIGTERM or SIGUSR1 to `mpt launch` (a scheduler's notice) becomes SIGUSR1 to the workers.

    The handler raises torch's ``SignalException`` with SIGUSR1 as its signal: the elastic agent
    then does what it does for its own signals, without restarting anything: it sends that
    signal to every worker, gives them the grace period to finish the step and save, and
    SIGKILLs the rest. Further signals while they save are ignored.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: str = ""
        """The name of the signal that preempted the job ("" while none did)."""
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.received = signal.Signals(signum).name
            raise SignalException(f"preempted by {self.received}", sigval=PREEMPT_SIGNAL)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def outcome(self, spec: LaunchSpec, notes: dict[int, Note]) -> Outcome:
        """Requeue when every rank of this node saved and exited; else the signal's code."""
        codes = {note.rank: note.exit_code for note in notes.values()}
        # An elastic job's node learns its ranks at the rendezvous: those that left a note.
        ranks = sorted(codes) if spec.elastic else [
            rank for node, _, rank in spec.world.all_processes() if node == spec.nr]
        missing = [r for r in ranks if codes.get(r) not in (0, REQUEUE_EXIT_CODE)]
        if not missing:
            code = REQUEUE_EXIT_CODE if REQUEUE_EXIT_CODE in codes.values() else 0
            return Outcome(code, (f"mpt: preempted by {self.received}: every rank of node "
                                  f"{spec.nr} stopped at the same step"
                                  + (f" and exited {code} (requeue me)" if code else ""),))
        return Outcome(128 + signal.Signals[self.received].value, (
            f"mpt: preempted by {self.received}: rank(s) {', '.join(map(str, missing))} did "
            f"not save and exit within --grace-period {spec.grace_period} s (do they call "
            "rt.step() with a --checkpoint-dir?)",))


def describe(failure: Failure, spec: LaunchSpec, beats: dict[int, Beat]) -> tuple[str, ...]:
    """The lines that report ``failure``, and the rank that likely caused it when the failed
    rank died waiting in a collective (a timeout) while a peer was elsewhere."""
    how = (f"was killed by {failure.signal}" if failure.signal
           else f"exited with code {failure.exit_code}")
    node = "this node" if spec.elastic else f"node {spec.nr}"  # elastic: from the rendezvous
    lines = [f"mpt: rank {failure.rank} ({node}, local rank {failure.local_rank}) {how};"
             " the job was stopped"]
    failed = beats.get(failure.rank)
    if failed is not None and failed.phase in WAITING_PHASES:
        now = time.time()
        culprits = [beat for beat in suspects(beats, now) if beat.rank != failure.rank]
        lines += [f"mpt: {beat.describe(now)} while rank {failure.rank} waited for it: the likely "
                  "cause" for beat in culprits]
        if not culprits and spec.nodes > 1:
            lines.append(f"mpt: rank {failure.rank} failed inside a collective with no local rank "
                         "to blame: a rank on another node probably failed first (see the other "
                         "nodes' `mpt launch`)")
    return (*lines, *local_rank_hint(spec, failure.exit_code))


def local_rank_hint(spec: LaunchSpec, exit_code: int) -> tuple[str, ...]:
    """The line that explains exit code 2 when mpt added ``--local_rank=N``."""
    return (LOCAL_RANK_HINT,) if spec.local_rank_arg and exit_code == 2 else ()


@contextlib.contextmanager
def agent_log(spec: LaunchSpec) -> Iterator[None]:
    """torch elastic's own reports (``E... failed (exitcode: 2)``, a restart) go to
    ``--log-dir``'s ``elastic.node<nr>.log`` (an elastic job's nodes have no ``--nr``:
    ``elastic.<address>.log``, by ``--local-addr`` or host name, so that nodes sharing the
    folder keep apart), not to the console: there mpt's one summary of a failure says which
    rank failed and how. Without a log dir they are dropped."""
    logger = logging.getLogger("torch.distributed.elastic")
    saved = logger.level, logger.propagate, list(logger.handlers)
    handler: logging.Handler = logging.NullHandler()
    if spec.log_dir is not None:
        try:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
            node = (spec.local_addr or socket.getfqdn()) if spec.elastic else f"node{spec.nr}"
            handler = logging.FileHandler(spec.log_dir / f"elastic.{node}.log")
        except OSError:
            pass  # RankLogs refuses the folder in one line, before any worker starts
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                               "%(message)s"))
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO if spec.log_dir is not None else logging.CRITICAL)
    try:
        yield
    finally:
        handler.close()
        logger.handlers = saved[2]
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def abandon(spec: LaunchSpec, seconds: float, report: Callable[[str], None],
            folders: Sequence[str | None]) -> NoReturn:
    """End this node, cut off from the rendezvous (``RendezvousWatch``): its agent is blocked
    in a store request that never returns, so the process ends here, with this launch's
    folders removed; its workers die with it (they are bound to this process)."""
    report(f"mpt: this node cannot reach the rendezvous at {spec.master_addr}:"
           f"{spec.master_port} for {seconds:.0f} s (--rdzv-timeout {spec.rdzv_timeout}): it is "
           "cut off from the job; ending its processes (the other nodes go on without it where "
           "--nodes allows)")
    for folder in folders:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def run(spec: LaunchSpec, report: Callable[[str], None],
        runtime_flags: Sequence[str] = ()) -> Outcome:
    """Run this node's share of the job to the end. ``report`` gets the stall warnings of the
    heartbeat watch while it runs. ``runtime_flags``: the flags given that only an
    ``mpt.Runtime`` applies, reported when the script never made one."""
    own_store = spec.run.snapshot_dir is None  # a store snapshot_store makes is ours
    with agent_log(spec), tempfile.TemporaryDirectory(prefix="mpt-launch-") as scratch, \
            snapshot_store(spec) as spec:
        # A Horovod script's hvd.init() joins us (a static job's: Horovod's world is fixed).
        rendezvous = HorovodRendezvous(address="") if spec.elastic else \
            HorovodRendezvous.start(spec)
        # The elastic agent passes its own environment on to the workers.
        os.environ.update({**worker_env(spec, scratch), **rendezvous.env(),
                           **(ELASTIC_AGENT_ENV if spec.elastic else {})})
        watch = StallWatch(scratch, spec.heartbeat_timeout, report)
        cut_off = None if spec.nodes == 1 else RendezvousWatch(
            (spec.master_addr, spec.master_port), spec.rdzv_timeout,
            lambda seconds: abandon(spec, seconds, report,
                                    [scratch, *([spec.run.snapshot_dir] if own_store else [])]))
        preemption = PreemptionRelay()
        try:
            elastic_launch(torch_launch_config(spec), sys.executable)(*spec.worker_args())
        except ChildFailedError as err:
            failure = root_cause(err.failures, Note.read_all(scratch))
            # Its one-line error went to its --log-dir file only: shown here, unless a rank on
            # the console (tee'd) said the same.
            hidden = spec.log_dir is not None and failure.rank not in spec.tee
            said = read_error(scratch, err.failures[failure.rank].pid) if hidden else ""
            if said in {read_error(scratch, f.pid) for r, f in err.failures.items()
                        if r in spec.tee}:
                said = ""
            return Outcome(failure.exit_code, (*([said] if said else []),
                                               *describe(failure, spec, read_beats(scratch))))
        except SignalException:
            return preemption.outcome(spec, Note.read_all(scratch))
        except RendezvousTimeoutError:  # an elastic job's survivors, fewer than MIN
            return Outcome(1, (below_min(spec.node_range, spec.rdzv_timeout,
                                         spec.run.checkpoint_dir),))
        except RendezvousError as err:  # the c10d store's node is gone, or never came
            return Outcome(1, (f"mpt: this node lost the rendezvous at {spec.master_addr}:"
                               f"{spec.master_port} ({' '.join(str(err).split())}); the node "
                               "that hosts it must stay for the whole job (see "
                               "docs/fault-tolerance.md)",))
        except DistError as err:  # raised by the agent itself: its store, the rendezvous
            return Outcome(1, (f"mpt: node {spec.nr} could not meet the other nodes at "
                               f"{spec.master_addr}:{spec.master_port} ({err}); start `mpt "
                               "launch` with the same --nodes/--master-addr/--master-port on "
                               f"every node within --rdzv-timeout ({spec.rdzv_timeout} s)",))
        finally:
            preemption.restore()
            watch.stop()
            if cut_off is not None:
                cut_off.stop()
            rendezvous.stop()
        unused = unapplied_flags(runtime_flags, Note.read_all(scratch))
    return Outcome(0, () if unused is None else (unused,))
