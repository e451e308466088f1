"""What each rank of `mpt launch` runs: the user's script, plus how it ended.

When one rank fails, its peers fail a few milliseconds later ("connection closed by peer"), and
torch's elastic agent finds them all dead in the same poll, stamped with the same second. To name
the rank that failed first, each rank notes the nanosecond it ended, its exit code, its rank,
whether it made an ``mpt.Runtime`` and whether it ran Horovod or DeepSpeed itself in
``$MPT_FAILURE_DIR/<pid>`` (a ``Note``); the launchers read them back. A refusal
(``UsageError``) raised on every rank reaches the console once.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Callable
from types import TracebackType

from mpt.environments import detect_world
from mpt.environments.settings import LOG_FILE, horovod_rendezvous, launch_dir
from mpt.errors import MptError, UsageError
from mpt.launchers.local_rank import LOCAL_RANK_ARG, with_local_rank
from mpt.launchers.notes import (
    LIBRARIES,
    Note,
    claim_message,
    library_initialised,
    runtime_made,
    write_error,
)

PREFIXED = "MPT_LINES_PREFIXED"
"""Set ("1") by `mpt launch` where the launcher tails this rank's stdout and stderr onto the
console with its rank before each line (``mpt.launchers.logs.ConsoleLogs``)."""


def _exit_code(exc: SystemExit) -> int:
    """The status Python exits with for ``exc``: None is 0, an int is itself, anything else 1."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _from_script(tb: TracebackType | None, script: str) -> TracebackType | None:
    """``tb`` from the first frame of ``script`` on (all of it if the script has none)."""
    path, head = os.path.abspath(script), tb
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    return tb or head


def _rank() -> int:
    """This process's global rank, for the note (-1 where the launcher's variables say none)."""
    try:
        return detect_world(os.environ).rank
    except MptError:
        return -1


def _excepthook(prefixed: bool) -> Callable[[type[BaseException], BaseException,
                                             TracebackType | None], object]:
    """``sys.excepthook``; Python's own instead of torch's when the output goes to this rank's log
    file or its lines are prefixed by the launcher: torch's puts "[rankN]: " before every line,
    and the launcher prefixes tee'd lines too."""
    if prefixed and getattr(sys.excepthook, "__module__", "") == \
            "torch.distributed.distributed_c10d":
        return sys.__excepthook__
    return sys.excepthook


def write_whole_lines() -> None:
    """One ``write`` per line on stdout and stderr: under ``-u`` Python writes each piece of a
    ``print`` at once (the text, then its newline), and torch's tail of a rank's file (``--log-dir
    --tee``), reading between the two, shows half a line with the rank's prefix and the rest
    under another. (mpt's own tail waits for the newline, and gets fewer writes to read.)"""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)


def main() -> None:
    logged = bool(os.environ.get(LOG_FILE))
    if logged:
        # stdout already goes to this rank's log file (mpt.launchers.logs); stderr joins it on the
        # same file description, so a traceback lands after the lines printed before it.
        sys.stderr.flush()
        os.dup2(1, 2)
    tailed = logged or bool(os.environ.get(PREFIXED))  # the launcher reads the lines back
    if tailed:
        write_whole_lines()
    rendezvous = horovod_rendezvous(os.environ)
    if rendezvous:  # before the script imports horovod: its hvd.init() joins this job
        from mpt.launchers.horovod_join import join_env

        os.environ.update(join_env(detect_world(os.environ), rendezvous))
    script, *args = sys.argv[1:]
    if script == LOCAL_RANK_ARG:
        # Scripts of the torch.distributed.launch era (Apex's examples) read their GPU from
        # argv; it put --local_rank=<N> before the script's own arguments, and so does this.
        script, *args = args
        args = with_local_rank(args, detect_world(os.environ).local_rank)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would
    failure_dir = launch_dir(os.environ)
    code = 1
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
        raise
    except UsageError as exc:  # bad input (a refused setting, a wrong call): one line, as the CLI
        message = f"mpt: error: {exc}"
        # Into this rank's own log always; on the shared console by the first rank that says it.
        if logged or failure_dir is None or claim_message(failure_dir, message):
            # One write: under -u a print writes the text and its newline apart, and a reader
            # such as horovodrun's may take them as two lines.
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        if logged and failure_dir:  # the launcher shows it where this rank is not tee'd
            write_error(failure_dir, os.getpid(), message)
        code = 2
        sys.exit(2)
    except Exception as exc:
        # Report it as `python script.py` would: without this shim's and runpy's frames.
        exc.with_traceback(_from_script(exc.__traceback__, script))
        _excepthook(tailed)(type(exc), exc, exc.__traceback__)
        sys.exit(1)
    finally:
        if failure_dir:  # clean exits too: a preempted launcher counts the ranks that saved
            ran = {library: int(library_initialised(library)) for library in LIBRARIES}
            Note(time.time_ns(), code, _rank(), int(runtime_made()), **ran).write(failure_dir,
                                                                               os.getpid())

if __name__ == "__main__":
    main()
