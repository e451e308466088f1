"""RendezvousWatch: a node that has reached the rendezvous host and then cannot for the timeout
is handed to ``on_lost`` once; one that never reached it, or stopped watching, is not."""

from __future__ import annotations

import socket
import threading
import time

from mpt.fault.link import RendezvousWatch


def listener() -> socket.socket:
    """A server that accepts and closes every connection until it is closed."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        try:
            while True:
                server.accept()[0].close()
        except OSError:  # closed
            return

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_host_that_answered_then_went_silent_is_reported_once_after_the_timeout():
    server = listener()
    lost: list[float] = []
    watch = RendezvousWatch(server.getsockname(), 0.6, lost.append, interval=0.1)
    time.sleep(0.5)  # answered a few times
    assert lost == []
    server.close()
    gone = time.monotonic()
    deadline = gone + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lost) == 1 and lost[0] >= 0.6, lost
    assert time.monotonic() - gone < 2.0  # the timeout and a probe or two, not more
    time.sleep(0.5)
    assert len(lost) == 1  # the watch ended with its report
    watch.stop()


def test_a_host_never_reached_or_a_stopped_watch_reports_nothing():
    server = listener()
    port = server.getsockname()[1]
    lost: list[float] = []
    never = RendezvousWatch(("127.0.0.1", free_port()), 0.2, lost.append, interval=0.05)
    stopped = RendezvousWatch(("127.0.0.1", port), 0.2, lost.append, interval=0.05)
    time.sleep(0.3)
    stopped.stop()  # the job ended: its store may go away now
    server.close()
    time.sleep(0.8)
    assert lost == []  # a node that never arrived is the rendezvous timeout's to end
    never.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
