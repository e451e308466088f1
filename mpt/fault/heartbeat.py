"""Heartbeats: each rank says where it is; the launcher names the ranks that stopped moving.

A rank's training thread only records ``(step, phase, since)`` in memory when it enters a phase
(forward/script, backward, step, collective, checkpoint); a daemon thread writes that to
``<folder>/heartbeat-<rank>`` once a second. The launcher reads the files: a rank whose phase
has not changed for ``--heartbeat-timeout`` seconds is reported while the job runs, and when a
job fails on a collective timeout the rank that was *not* waiting in a collective is named.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

WAITING_PHASES = frozenset({"backward", "step", "collective", "checkpoint"})
"""Phases in which a rank may be waiting for its peers (a collective runs in each)."""

PHASE_WORDS = {"script": "the script's own code (forward, data loading, ...)",
               "backward": "backward (and its gradient all-reduce)", "step": "the optimizer step",
               "collective": "a collective (all_reduce, barrier)", "checkpoint": "a checkpoint",
               "starting": "start-up", "closing": "shutdown"}


@dataclass(frozen=True, slots=True)
class Beat:
    """What one rank last said about itself."""

    rank: int
    """Its global rank."""
    step: int
    """Optimizer steps it had finished."""
    phase: str
    """Where it was: a key of PHASE_WORDS."""
    since: float
    """Wall-clock time it entered that phase (or finished that step)."""
    written: float
    """Wall-clock time of the heartbeat; a stale one means a frozen process."""

    def stuck_for(self, now: float) -> float:
        return now - self.since

    def describe(self, now: float) -> str:
        return (f"rank {self.rank}: step {self.step}, in {PHASE_WORDS.get(self.phase, self.phase)}"
                f" for {self.stuck_for(now):.1f} s")


class Heartbeat:
    """This rank's side: the phase in memory, a file written once a second by a daemon thread."""

    def __init__(self, folder: str, rank: int, interval: float = 1.0) -> None:
        self._path = Path(folder, f"heartbeat-{rank}")
        self._rank, self._interval = rank, interval
        self._state = (0, "starting", time.time())
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._run, name="mpt-heartbeat", daemon=True)
        self._thread.start()

    def mark(self, phase: str, step: int | None = None) -> None:
        """Enter ``phase`` (at ``step``, when it changes): two attribute writes, no I/O."""
        self._state = (self._state[0] if step is None else step, phase, time.time())

    def _write(self) -> None:
        step, phase, since = self._state
        beat = Beat(self._rank, step, phase, since, time.time())
        tmp = self._path.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_text(json.dumps(asdict(beat)))
        os.replace(tmp, self._path)  # the launcher never reads half a beat

    def _run(self) -> None:
        # The last beat also on the way out: a rank that fails within a second of entering its
        # phase (a peer's death seen in a collective) must still say where it failed.
        atexit.register(self._write)
        while not self._stop.wait(self._interval):
            self._write()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def read_beats(folder: str) -> dict[int, Beat]:
    """Every rank's last heartbeat in ``folder``, by rank."""
    beats = {}
    for path in Path(folder).glob("heartbeat-*"):
        if path.suffix.startswith(".tmp"):
            continue
        try:
            beat = Beat(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # replaced while we read it: the next read has it
        beats[beat.rank] = beat
    return beats


def suspects(beats: dict[int, Beat], now: float, min_age: float = 1.0) -> list[Beat]:
    """The ranks that likely hung the others: outside any collective for ``min_age`` seconds
    or more while at least one peer waited in one. Empty when the picture is not that clear."""
    waiting = [b for b in beats.values() if b.phase in WAITING_PHASES]
    idle = [b for b in beats.values() if b.phase not in WAITING_PHASES
            and b.stuck_for(now) >= min_age]
    return sorted(idle, key=lambda b: b.rank) if waiting and idle else []


class StallWatch:
    """The launcher's side: a thread that reports each rank stuck in one phase for ``timeout``."""

    def __init__(self, folder: str, timeout: float, report: Callable[[str], None]) -> None:
        self._folder, self._timeout, self._report = folder, timeout, report
        self._reported: set[tuple[int, float]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpt-stall-watch", daemon=True)
        if timeout > 0:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(min(self._timeout / 4, 5.0)):
            now = time.time()
            for beat in read_beats(self._folder).values():
                if beat.stuck_for(now) >= self._timeout and (beat.rank, beat.since) not in \
                        self._reported:
                    self._reported.add((beat.rank, beat.since))
                    frozen = (f"; its heartbeat stopped {now - beat.written:.0f} s ago (the "
                              "process is frozen)" if now - beat.written > self._timeout / 2
                              else "")
                    self._report(f"mpt: no progress (--heartbeat-timeout {self._timeout:g} s) on "
                                 f"{beat.describe(now)}{frozen}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
