"""The `mpt` command: `python -m mpt` and the console script (``run``)."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys


def run() -> None:
    """``mpt.cli.main``, then out of the process without the interpreter's teardown.

    A finished command has nothing left to do once the handlers registered with ``atexit``
    have run: the teardown after them frees every module's objects one by one, 0.3-0.6 s in a
    process that imported torch here, more than all of `mpt launch`'s own work before its
    workers start. So the first handler registered, which runs last, flushes the streams and
    ends the process with the code it was exiting with. An uncaught exception (a traceback, ^C)
    leaves the usual way.
    """
    code = 0

    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe reads no more
                stream.flush()
        os._exit(code)

    atexit.register(leave)  # before mpt.cli imports torch, whose handlers then run before it
    from mpt.cli import main

    try:
        main()
    except SystemExit as exc:  # Python prints a message given as the code, and exits with 1
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        raise
    except BaseException:
        atexit.unregister(leave)
        raise


if __name__ == "__main__":
    run()
