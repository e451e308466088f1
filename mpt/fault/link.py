"""A node cut off from the rendezvous ends instead of waiting for ever.

When a node's link goes silent (cable, switch, a cloud network partition: no packet arrives and
no socket closes), the other nodes learn of it when their collective times out, drop it from the
rendezvous and go on. The cut-off node's own agent does not end: it is blocked inside a store
request to the rendezvous host that never gets an answer (torch's store client does not time
out on a silent link; measured on the emulated cluster, docs/fault-tolerance.md). Nothing in it
can be interrupted from Python.

``RendezvousWatch`` is a thread of `mpt launch` that opens a TCP connection to the rendezvous
host every few seconds (connect and close: the store takes it as a client that left). Once the
host has answered and then stays unreachable for ``timeout`` seconds (``--rdzv-timeout``, the
time a node may take to arrive at all), this node is out of the job: the watch hands over to
``on_lost``, which reports it and ends the process (its workers die with it).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

PROBE_INTERVAL = 2.0
"""Seconds between two probes, and how long one connect may take."""


class RendezvousWatch:
    """Calls ``on_lost(seconds)`` once ``address`` has answered and then stayed unreachable for
    ``timeout`` seconds (see the module's docstring)."""

    def __init__(self, address: tuple[str, int], timeout: float,
                 on_lost: Callable[[float], None], interval: float = PROBE_INTERVAL) -> None:
        self._address, self._timeout, self._interval = address, timeout, interval
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpt-rendezvous-watch",
                                        daemon=True)
        self._thread.start()

    def _reachable(self) -> bool:
        try:
            socket.create_connection(self._address, timeout=self._interval).close()
        except OSError:
            return False
        return True

    def _run(self) -> None:
        answered: float | None = None  # the last time the host answered
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            if self._reachable():
                answered = now
            elif answered is not None and now - answered >= self._timeout:
                if not self._stop.is_set():  # the job did not end meanwhile
                    self._on_lost(now - answered)
                return

    def stop(self) -> None:
        """No more probes (the thread, a daemon, ends within one interval)."""
        self._stop.set()
