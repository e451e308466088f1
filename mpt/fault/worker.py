"""A worker's side of fault handling: bound to its launcher's life, beating a heartbeat the
launcher watches, and stopping at an agreed step when the job is preempted."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator, Mapping

import torch

from mpt._native import bind_to_parent
from mpt.environments import World
from mpt.environments.settings import launch_dir, launcher_pid
from mpt.fault.heartbeat import Heartbeat
from mpt.fault.preemption import REQUEUE_EXIT_CODE, Preemption

SumAsync = Callable[[torch.Tensor], Callable[[], None]]
"""Starts a sum of a tensor over every rank in place; the call it returns waits for it."""


def die_with_launcher(pid: int | None) -> None:
    """Have the kernel SIGKILL this worker when the `mpt launch` that started it dies.

    The elastic agent stops workers when it exits normally, but a launcher killed with SIGKILL
    (OOM killer, a scheduler) runs no cleanup: without this its workers would live on, holding
    GPUs and ports.
    """
    if pid is None:
        return
    if os.getppid() != pid and _pid_exists(pid):
        return  # a process the worker started inherited the variable: not the launcher's child
    if not bind_to_parent(signal.SIGKILL, pid):
        raise SystemExit(f"mpt: the launcher (pid {pid}) is gone; this worker stops too")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    return True


class WorkerFaults:
    """What `mpt launch` needs from one worker to end a job cleanly: the worker dies with the
    launcher, tells it where it is (the heartbeat names a stalled rank), and honours a
    preemption at a step every rank agrees on. Outside `mpt launch` only preemption remains."""

    def __init__(self, world: World, env: Mapping[str, str], *, sum_async: SumAsync) -> None:
        die_with_launcher(launcher_pid(env))
        scratch = launch_dir(env)  # under `mpt launch`: its stall watch reads our heartbeat
        self._heartbeat = Heartbeat(scratch, world.rank) if scratch else None
        self._preemption = Preemption()
        self._world_size = world.world_size
        self._sum_async = sum_async
        """Starts a sum over every rank: how the ranks agree to stop (the backend's)."""

    def mark(self, phase: str, step: int | None = None) -> None:
        """Tell the heartbeat where this rank is (a no-op outside `mpt launch`)."""
        if self._heartbeat is not None:
            self._heartbeat.mark(phase, step)

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Mark ``phase`` for the block, then ``script``; a block that raises leaves its phase
        in the heartbeat, which is where the rank failed."""
        self.mark(phase)
        yield
        self.mark("script")

    def should_stop(self) -> bool:
        """At the end of a training iteration: whether every rank stops here (collective)."""
        return self._preemption.should_stop(self._sum_async, self._world_size)

    def stop_if_preempted(self, step: int, *, save: Callable[[], str] | None,
                          close: Callable[[], None], say: Callable[[str], None]) -> None:
        """At the end of training iteration ``step`` (collective): where the job is preempted,
        commit a checkpoint with ``save`` (None: nowhere to save), ``close`` the run and exit
        with ``REQUEUE_EXIT_CODE``, on every rank at the same iteration."""
        if not self.should_stop():
            return
        if save is not None:  # committed before the process exits
            say(f"mpt: preempted: saved step {step} to {save()}; exiting with "
                f"{REQUEUE_EXIT_CODE} (requeue)")
        else:
            say(f"mpt: preempted at step {step} with no --checkpoint-dir: nothing saved; "
                f"exiting with {REQUEUE_EXIT_CODE}")
        close()
        raise SystemExit(REQUEUE_EXIT_CODE)

    def settle(self) -> None:
        """Wait for the preemption check in flight: a collective, so before the process group
        is left."""
        self._preemption.close()

    def close(self) -> None:
        """Stop beating; the last beat stays, naming the phase this rank ended in."""
        self.settle()
        if self._heartbeat is not None:
            self._heartbeat.close()
