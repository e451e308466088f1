"""Native helpers with a pure-Python fallback, so an install without a compiler behaves the same.

`mpt._C` is optional (built by setup.py through CMake from `backends/csrc`, skipped with
MPT_SKIP_COMPILE=1 or when cmake / a C++ compiler is missing). Everything it offers is also
reachable here through ctypes; `NATIVE_AVAILABLE` tells `mpt env` which one is in use.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from types import ModuleType
from typing import Literal

from mpt.errors import UsageError

_C: ModuleType | None
try:
    from mpt import _C
except ImportError:
    _C = None

NATIVE_AVAILABLE: bool = _C is not None
"""Whether the compiled extension `mpt._C` was built and imports."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def bind_to_parent(
    signum: int = signal.SIGTERM,
    expected_parent_pid: int | None = None,
    *,
    via: Literal["auto", "native", "ctypes"] = "auto",
) -> bool:
    """Have the kernel send `signum` to this process when its parent dies (Linux only).

    Workers call this first thing, so a launcher killed with SIGKILL cannot leave them running.
    `expected_parent_pid` is the parent's pid captured as early as possible (best: the launcher
    passes its own pid to the worker); None takes `os.getppid()` now. Returns False when the
    parent is already gone (the caller should exit); on non-Linux it does nothing and returns
    True. The signal fires when the parent *thread* that spawned us exits, so a launcher must
    spawn workers from a long-lived thread. `via` picks the implementation: "auto" uses mpt._C
    when built, else ctypes.
    """
    if via not in ("auto", "native", "ctypes"):
        raise UsageError("via", via, "unknown implementation", "use 'auto', 'native' or 'ctypes'")
    if not 1 <= int(signum) < signal.NSIG:
        raise UsageError("signum", signum, "not a signal number", "pass e.g. signal.SIGTERM")
    expected = os.getppid() if expected_parent_pid is None else int(expected_parent_pid)
    if via == "native" or (via == "auto" and _C is not None):
        if _C is None:
            raise UsageError(
                "via", via, "mpt._C was not built", "reinstall with cmake and a C++ compiler"
            )
        return bool(_C.set_parent_death_signal(int(signum), expected))
    if not sys.platform.startswith("linux"):
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    args = (ctypes.c_ulong(int(signum)), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, {int(signum)}) failed: {os.strerror(err)}")
    return os.getppid() == expected
