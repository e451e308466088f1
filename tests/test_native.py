"""mpt._native.bind_to_parent with real processes: a worker must not outlive its launcher.

Each scenario is a real process tree, pytest -> parent -> worker. The parent is SIGKILLed (no
cleanup can run) and the worker must die from its parent-death signal. Both implementations are
exercised: the compiled mpt._C and the ctypes fallback (chosen with `via=`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mpt._native as native
from mpt.errors import UsageError

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="parent-death signals are Linux-only"
)

MPT_DIR = str(Path(native.__file__).parent)

# The worker imports mpt._native without running mpt/__init__.py (which imports torch, ~1.3 s):
# a bare package object pointing at the same folder keeps each worker's start under 0.1 s.
WORKER = """
import os, signal, sys, time, types
mpt_dir, via, mode = sys.argv[1:4]
pkg = types.ModuleType("mpt"); pkg.__path__ = [mpt_dir]; sys.modules["mpt"] = pkg
from mpt._native import bind_to_parent
if mode == "orphan":  # wait until the parent is gone, then bind with its (stale) pid
    expected = int(sys.argv[4])
    deadline = time.monotonic() + 5
    while os.getppid() == expected and time.monotonic() < deadline:
        time.sleep(0.01)
    print(bind_to_parent(signal.SIGTERM, expected, via=via), flush=True)
    sys.exit(0)
print(bind_to_parent(signal.SIGTERM, via=via) if via != "unbound" else "unbound", flush=True)
time.sleep(30)
"""

# Starts the worker, reports "<worker pid> <worker's first line>", then waits to be killed.
PARENT = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
print(worker.pid, worker.stdout.readline().strip(), flush=True)
time.sleep(30)
"""

# Starts the worker (which inherits our stdout) and exits at once: the worker is orphaned first.
SHORT_LIVED_PARENT = """
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", *sys.argv[1:], str(os.getpid())])
"""

VIAS = [
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not native.NATIVE_AVAILABLE,
            reason="mpt._C was not built (MPT_SKIP_COMPILE=1, or no cmake / C++ compiler)",
        ),
    ),
    "ctypes",
]


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, not yet reaped by its new parent) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _kill_parent_then_check_worker(via: str) -> tuple[str, bool]:
    """Run pytest -> parent -> worker, SIGKILL the parent; return (worker's bind result, gone?)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, WORKER, MPT_DIR, via, "bind"],
        stdout=subprocess.PIPE,
        text=True,
    )
    worker_pid = 0
    try:
        pid_text, _, result = parent.stdout.readline().strip().partition(" ")
        worker_pid = int(pid_text)
        parent.kill()
        parent.wait(timeout=5)
        return result, _wait_gone(worker_pid, timeout=0.5 if via == "unbound" else 5)
    finally:
        parent.kill()
        parent.wait(timeout=5)
        parent.stdout.close()
        if worker_pid and _alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


@pytest.mark.parametrize("via", VIAS)
def test_worker_dies_when_its_parent_is_killed(via: str) -> None:
    result, gone = _kill_parent_then_check_worker(via)
    assert result == "True"
    assert gone, f"worker bound via {via} outlived its SIGKILLed parent"


def test_unbound_worker_survives_its_parent() -> None:
    """Control: without bind_to_parent the worker outlives the parent, so the test above bites."""
    result, gone = _kill_parent_then_check_worker("unbound")
    assert result == "unbound"
    assert not gone


@pytest.mark.parametrize("via", VIAS)
def test_returns_false_when_the_parent_died_before_binding(via: str) -> None:
    parent = subprocess.run(
        [sys.executable, "-c", SHORT_LIVED_PARENT, WORKER, MPT_DIR, via, "orphan"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert parent.stdout.strip() == "False", parent.stderr


def test_rejects_bad_arguments_before_touching_the_process() -> None:
    with pytest.raises(UsageError, match="signum=0"):
        native.bind_to_parent(0)
    with pytest.raises(UsageError, match="via=cuda"):
        native.bind_to_parent(signal.SIGTERM, via="cuda")  # type: ignore[arg-type]
    if not native.NATIVE_AVAILABLE:
        with pytest.raises(UsageError, match=r"mpt\._C was not built"):
            native.bind_to_parent(signal.SIGTERM, via="native")


@pytest.mark.skipif(not native.NATIVE_AVAILABLE, reason="mpt._C was not built")
def test_extension_validates_signum_itself() -> None:
    from mpt import _C

    with pytest.raises(ValueError, match="signum=0"):
        _C.set_parent_death_signal(0)
