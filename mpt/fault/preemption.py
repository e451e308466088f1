"""Preemption: a signal asks every rank to stop after the same step, save, and exit "requeue me".

SLURM and Kubernetes give notice before they take the nodes: SIGTERM or SIGUSR1 to the job.
`mpt launch` turns either into SIGUSR1 for its workers. A rank only notes the request in its
handler; at each optimizer step it tells its peers through an asynchronous all-reduce of one
integer and reads the answer for the previous step, so the decision costs no wait on the training
stream and every rank stops after the same step, even when the signal reached them at different
points of it. The price: a rank stops one step after the step during which it was asked.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

import torch

REQUEUE_EXIT_CODE = 75
"""Exit code of a preempted job that saved its checkpoint: ``EX_TEMPFAIL`` of sysexits.h, "try
again later". A batch script requeues the job when `mpt launch` exits with it."""

PREEMPT_SIGNAL = signal.SIGUSR1
"""What `mpt launch` sends its workers when it is told to stop (SIGTERM or SIGUSR1)."""


class Preemption:
    """The stop request of one rank, and the step at which all ranks agreed to honour it."""

    def __init__(self) -> None:
        self.requested = False
        """True once this rank received the preemption signal."""
        self._flag = torch.zeros(1, dtype=torch.int64)  # CPU: no wait on a GPU stream
        self._pending: Callable[[], None] | None = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(PREEMPT_SIGNAL) == signal.SIG_DFL):  # a script's own wins
            signal.signal(PREEMPT_SIGNAL, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # acted on at the next step boundary, never inside a collective

    def should_stop(self, sum_async: Callable[[torch.Tensor], Callable[[], None]]) -> bool:
        """Called by every rank once per optimizer step: True on every rank at the same step.

        ``sum_async`` starts a sum of a CPU tensor over all ranks and returns its wait.
        """
        stop = False
        if self._pending is not None:
            self._pending()
            stop = bool(self._flag.item())
        self._flag.fill_(int(self.requested))
        self._pending = sum_async(self._flag)
        return stop

    def close(self) -> None:
        """Wait for the sum in flight, so the process group is not left with a pending call."""
        if self._pending is not None:
            self._pending()
            self._pending = None
