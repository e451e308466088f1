"""Notes the workers leave in the launch's scratch folder, read back by the launchers.

``mpt.launchers.worker`` writes one ``Note`` per rank when its script ends (how, when, which rank,
whether it ever made an ``mpt.Runtime``, whether it ran Horovod or DeepSpeed itself) into
``$MPT_FAILURE_DIR``; the launchers read them to name the rank that failed first (torch's and
horovodrun's own reports often name a peer that only failed because of it), and to say when the
flags that only the Runtime applies went unused.
The worker also claims each one-line error it prints there, so that the same refusal raised on
every rank reaches the console once.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

MIGRATION_GUIDES = "docs/migration/README.md"
"""Where a user whose script never made an ``mpt.Runtime`` reads how to make one."""

LIBRARIES = ("horovod", "deepspeed")
"""Backends a script may also run by itself, without ``mpt.Runtime``; each a ``Note`` field."""

_runtime_made = False


def note_runtime() -> None:
    """Called by ``mpt.Runtime`` when it is made: this process's note says so (the launcher
    reports run flags that no Runtime applied). Memory only: no file, no variable read."""
    global _runtime_made
    _runtime_made = True


def runtime_made() -> bool:
    """Whether this process made an ``mpt.Runtime``."""
    return _runtime_made


def library_initialised(library: str) -> bool:
    """Whether ``library`` (one of ``LIBRARIES``) was initialised in this process, by the
    library's own query. Read only where the script imported it: importing it here would cost
    seconds and prove nothing. A script that shuts Horovod down itself (``hvd.shutdown()``)
    before it ends reads as one that never started it."""
    try:
        if library == "horovod":
            hvd = sys.modules.get("horovod.torch")
            return hvd is not None and bool(hvd.is_initialized())
        if library == "deepspeed":
            comm = sys.modules.get("deepspeed.comm.comm")
            # Its backend object outlives the process group a script destroys at its end.
            return comm is not None and (bool(comm.is_initialized())
                                         or getattr(comm, "cdb", None) is not None)
    except (AttributeError, RuntimeError, ValueError):  # half-imported or broken: did not run
        return False
    raise ValueError(f"library={library!r} is not one of {LIBRARIES}")


class Note(NamedTuple):
    """What ``mpt.launchers.worker`` writes when a rank's script ends."""

    failed_at: int
    """``time.time_ns()`` when the script ended."""
    exit_code: int
    """The code the script exited with."""
    rank: int = -1
    """The rank's global rank (-1: unknown)."""
    runtime: int = 0
    """1 where the script made an ``mpt.Runtime``."""
    horovod: int = 0
    """1 where Horovod was initialised in the process when the script ended (``hvd.init()``)."""
    deepspeed: int = 0
    """1 where DeepSpeed's communication was initialised in the process when the script ended
    (``deepspeed.initialize`` or ``deepspeed.init_distributed``)."""

    @classmethod
    def read(cls, path: Path) -> Note:
        return cls(*map(int, path.read_text().split()))

    def write(self, folder: str, pid: int) -> None:
        """Write whole, then rename: the launcher never reads half a note."""
        path = os.path.join(folder, str(pid))
        with open(path + ".tmp", "w") as out:
            out.write(" ".join(map(str, self)))
        os.replace(path + ".tmp", path)

    @classmethod
    def read_all(cls, folder: str) -> dict[int, Note]:
        """The notes in ``folder``, by the pid of the process that wrote them."""
        return {int(p.name): cls.read(p) for p in Path(folder).iterdir() if p.name.isdigit()}


def claim_message(folder: str, message: str) -> bool:
    """True for the first process of the launch to claim ``message`` (it prints it), False for
    every other: ranks that hit the same refusal print it once between them."""
    digest = hashlib.sha256(message.encode()).hexdigest()[:24]
    try:
        os.close(os.open(os.path.join(folder, f"said-{digest}"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def write_error(folder: str, pid: int, message: str) -> None:
    """The one-line error a rank wrote into its own ``--log-dir`` file, for the launcher to
    show where that rank's output does not reach the console (it is not tee'd)."""
    path = os.path.join(folder, f"error-{pid}")
    with open(path + ".tmp", "w") as out:
        out.write(message)
    os.replace(path + ".tmp", path)


def read_error(folder: str, pid: int) -> str:
    """What ``write_error`` left for process ``pid`` ("" where it left nothing)."""
    path = Path(folder) / f"error-{pid}"
    return path.read_text() if path.is_file() else ""


def unapplied_flags(flags: Iterable[str], notes: Mapping[int, Note]) -> str | None:
    """The line `mpt launch` prints when its run flags had no effect: ``flags`` were given, the
    ranks ended (``notes``) and none of them made the ``mpt.Runtime`` that applies them. Not
    where the script ran the library ``--backend`` named itself (``hvd.init()`` under
    ``--backend horovod``): the line's "runs as under torchrun" would be false there."""
    flags = list(flags)
    if not flags or not notes or any(note.runtime for note in notes.values()):
        return None
    named = {flag.removeprefix("--backend ") for flag in flags if flag.startswith("--backend ")}
    if any(getattr(note, library) for library in named & set(LIBRARIES)
           for note in notes.values()):
        return None
    return (f"mpt: {' '.join(flags)} had no effect: the script never created mpt.Runtime, "
            f"which applies {'them' if len(flags) > 1 else 'it'} (a script that uses "
            f"torch.distributed alone runs as under torchrun); {MIGRATION_GUIDES} shows the "
            "lines to add")
