"""Preemption: a signal asks every rank to stop after the same step, save, and exit "requeue me".

SLURM and Kubernetes give notice before they take the nodes: SIGTERM or SIGUSR1 to the job.
`mpt launch` turns either into SIGUSR1 for its workers. A rank only notes the request in its
handler; at its optimizer steps it tells its peers through an asynchronous sum over all ranks and
reads the sum it started at its previous check, so the decision never waits on the training
stream, and every rank stops after the same step even when the signal reached them at different
points of one.

A check costs 0.4-1 ms on a 2-core machine whose cores are busy training (gloo's thread must
wait for a core; measured: benchmarks/preemption_overhead.py), too much for every 5 ms step. So
the ranks check every ``every`` steps, about every ``CHECK_INTERVAL`` seconds of training: each
check also sums the ranks' step times, and every rank derives the next ``every`` from that same
sum, so all ranks keep checking at the same steps. A request is honoured within about two
intervals plus a step: about a second, against the minutes of notice schedulers give.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import torch

REQUEUE_EXIT_CODE = 75
"""Exit code of a preempted job that saved its checkpoint: ``EX_TEMPFAIL`` of sysexits.h, "try
again later". A batch script requeues the job when `mpt launch` exits with it."""

PREEMPT_SIGNAL = signal.SIGUSR1
"""What `mpt launch` sends its workers when it is told to stop (SIGTERM or SIGUSR1)."""

CHECK_INTERVAL = 0.5
"""Seconds of training between two checks, aimed at (they fall on step boundaries)."""

MAX_EVERY = 1000
"""Most steps between two checks (for steps far shorter than CHECK_INTERVAL / 1000)."""


class Preemption:
    """The stop request of one rank, and the step at which all ranks agreed to honour it."""

    def __init__(self) -> None:
        self.requested = False
        """True once this rank received the preemption signal."""
        self.every = 1
        """Steps between two checks; the same on every rank (derived from the sums)."""
        self._sum = torch.zeros(2, dtype=torch.float64)  # [requests, seconds per step]: CPU
        self._pending: Callable[[], None] | None = None
        self._steps, self._checked_at = 0, time.perf_counter()  # since the last check
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(PREEMPT_SIGNAL) == signal.SIG_DFL):  # a script's own wins
            signal.signal(PREEMPT_SIGNAL, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # acted on at a step boundary, never inside a collective

    def should_stop(self, sum_async: Callable[[torch.Tensor], Callable[[], None]],
                    world_size: int) -> bool:
        """Called by every rank once per optimizer step: True on every rank at the same step.

        ``sum_async`` starts a sum of a CPU tensor over all ranks and returns its wait.
        """
        self._steps += 1
        if self._steps < self.every:
            return False
        stop = False
        if self._pending is not None:
            self._pending()
            stop = self._sum[0].item() > 0
            step_time = self._sum[1].item() / world_size  # the same number on every rank
            self.every = min(MAX_EVERY, max(1, math.ceil(CHECK_INTERVAL / max(step_time, 1e-9))))
        now = time.perf_counter()
        self._sum[0], self._sum[1] = float(self.requested), (now - self._checked_at) / self._steps
        self._steps, self._checked_at = 0, now
        self._pending = sum_async(self._sum)
        return stop

    def close(self) -> None:
        """Wait for the sum in flight, so the process group is not left with a pending call."""
        if self._pending is not None:
            self._pending()
            self._pending = None
