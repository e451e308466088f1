"""`mpt launch --log-dir D [--tee RANKS]`: one log file per rank, chosen ranks on the console.

torch's ``DefaultLogsSpecs`` writes ``D/<run_id>_<random>/attempt_<k>/<local_rank>/{stdout,
stderr}.log``: two files per process, named by LOCAL rank (so two nodes sharing ``D`` collide),
split so that a traceback cannot be read next to the lines printed before it, and tee'd to the
console from every rank without saying which rank wrote a line. ``RankLogs`` writes instead::

    D/rank0.log               rank 0's stdout and stderr, in the order it wrote them
    D/rank1.restart1.log      rank 1 after the gang's first restart (the first attempt is kept)
    D/previous-<time>/        what an earlier job left in D, moved aside rather than overwritten
    D/.errors/                torch's per-process error files (written by ``@record`` scripts)

and tails only the ``tee`` ranks' files to the console, each line prefixed by the agent with
``LOG_LINE_PREFIX`` (the global rank).

Without ``--log-dir``, ``ConsoleLogs`` shows every rank on the console as torchrun's ``--tee 3``
does: whole lines, each prefixed with its rank where the job has several (see its docstring).
"""

from __future__ import annotations

import contextlib
import os
import re
import string
import sys
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import BinaryIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from mpt.environments.settings import LOG_FILE, launch_dir
from mpt.errors import UsageError
from mpt.launchers.worker import PREFIXED

LOG_LINE_PREFIX = "[rank${rank}]: "
"""``LaunchConfig.log_line_prefix_template``: the agent substitutes the GLOBAL rank (``$rank``;
``$local_rank`` would repeat on every node) and puts it before every tee'd line."""

DEFAULT_TEE = frozenset({0})
"""Ranks shown on the console when ``--tee`` is not given."""

_LOG_NAME = re.compile(r"rank(\d+)(?:\.restart\d+)?\.(?:log|json)")
"""Names of the files ``RankLogs`` writes (logs, and error files under ``.errors``)."""


def parse_tee(value: str, world_size: int) -> frozenset[int]:
    """``--tee``'s value: comma-separated global ranks, or ``all``, checked against the world."""
    if value.strip().lower() == "all":
        return frozenset(range(world_size))
    try:
        ranks = frozenset(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise UsageError("--tee", value, "it is not a list of ranks",
                         "pass global ranks separated by commas, e.g. --tee 0,1, or --tee all"
                         ) from None
    outside = sorted(r for r in ranks if not 0 <= r < world_size)
    if not ranks or outside:
        raise UsageError("--tee", value, f"the job has ranks 0..{world_size - 1} only"
                         if outside else "it names no rank",
                         f"pass ranks below the world size {world_size}, or --tee all")
    return ranks


def rank_logs(log_dir: Path | None, tee: frozenset[int] = DEFAULT_TEE) -> LogsSpecs:
    """Where the workers' output goes: ``RankLogs`` with a log dir; without one, the console,
    whole lines per rank (``ConsoleLogs``)."""
    return ConsoleLogs() if log_dir is None else RankLogs(log_dir, tee)


class ConsoleLogs(LogsSpecs):
    """Every rank on the console, in whole lines, each prefixed with its global rank
    (``LOG_LINE_PREFIX``) where the job has several ranks; a job of one rank keeps the console
    as it is, unprefixed.

    Ranks that share the console directly interleave inside a line: ``print`` writes the text
    and its newline apart, and another rank's text lands between them (``Loss: 2.31Train
    Epoch: 5``), with nothing to say which rank wrote what. So, as torchrun's ``--tee 3`` does,
    each rank's stdout and stderr go to files, copied onto the launcher's stdout and stderr a
    whole line at a time with the rank before each: by the ``ConsoleTail`` of the enclosing
    ``console_lines()`` (`mpt launch`), else by torch's agent, whose tail polls every 0.1 s, also
    when it is told to stop (and the worker writes each line whole for it: MPT_LINES_PREFIXED).
    The files live in the launch's scratch folder (``folder``, by default ``$MPT_FAILURE_DIR``,
    which `mpt launch` removes when it ends); where there is none, the console is left as it is.
    """

    def __init__(self, folder: Path | None = None) -> None:
        super().__init__(log_dir=None if folder is None else str(folder))
        self.folder = folder

    @property
    def root_log_dir(self) -> str:
        return str(self._folder() or "")

    def _folder(self) -> Path | None:
        """Where this attempt's files go: ``folder``, or the running launch's scratch folder
        (read when the agent asks: `mpt launch` exports it just before it starts the agent)."""
        if self.folder is not None:
            return self.folder
        scratch = launch_dir(os.environ)
        return None if scratch is None else Path(scratch) / "console"

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Each local rank's stdout and stderr files, tailed, where the job has several ranks;
        the console itself (``""``) where it has one. The agent reads each rank's error file
        when it fails (written by torch's ``@record``), so every rank has one."""
        dest = LogsDest(stdouts=dict.fromkeys(envs, ""), stderrs=dict.fromkeys(envs, ""))
        folder = self._folder()
        if folder is None:  # torch's way of saying "no error file"
            dest.error_files = dict.fromkeys(envs, os.devnull)
            for env in envs.values():
                env["TORCHELASTIC_ERROR_FILE"] = ""
            return dest
        some_env = next(iter(envs.values()), {})
        attempt = folder / f"restart{some_env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        attempt.mkdir(parents=True, exist_ok=True)
        several = int(some_env.get("WORLD_SIZE", len(envs))) > 1
        tail = _TAIL.get()
        for local, env in envs.items():
            rank = env["RANK"]
            dest.error_files[local] = env["TORCHELASTIC_ERROR_FILE"] = str(
                attempt / f"rank{rank}.json")
            if not several:
                continue
            dest.stdouts[local] = str(attempt / f"rank{rank}.out")
            dest.stderrs[local] = str(attempt / f"rank{rank}.err")
            env[PREFIXED] = "1"
            if tail is not None:
                prefix = string.Template(LOG_LINE_PREFIX).substitute(rank=rank)
                tail.add(dest.stdouts[local], prefix, "stdout")
                tail.add(dest.stderrs[local], prefix, "stderr")
            else:
                dest.tee_stdouts[local] = dest.stdouts[local]
                dest.tee_stderrs[local] = dest.stderrs[local]
        if several and tail is None and hasattr(sys.stdout, "reconfigure"):
            # The agent's tail writes the lines on the launcher's stdout without a flush: flushed
            # at each line as the ranks' own were (through a pipe it would hold them till exit).
            sys.stdout.reconfigure(line_buffering=True)
        return dest

    def __repr__(self) -> str:
        return f"ConsoleLogs(folder={str(self.folder) if self.folder else None!r})"


class ConsoleTail:
    """Copies files that ranks write onto the launcher's stdout or stderr, a whole line at a
    time with a prefix, from one thread that looks every ``POLL_S`` seconds. ``stop`` copies
    what is left, the last line even without its newline, and returns once all of it is out:
    what the launcher says after the job (which rank failed) comes after the ranks' last lines.
    """

    POLL_S = 0.05
    LONGEST = 1 << 16
    """Bytes without a newline written out as they are: a line that long is no line to read,
    and a progress bar that only ever returns its carriage must not grow without end."""

    def __init__(self) -> None:
        self._files: list[_TailedFile] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, path: str, prefix: str, stream: str) -> None:
        """Copy ``path`` (it may not exist yet) onto ``sys.<stream>``, ``prefix`` before each
        line; from now on, and until ``stop``."""
        with self._lock:
            self._files.append(_TailedFile(path, prefix, stream))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mpt-console-tail",
                                                daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Copy the rest of every file, then return (the writers have ended)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            final = self._stopping.is_set()
            with self._lock:
                files = list(self._files)
            for tailed in files:
                tailed.copy(final)
            if final:
                return
            self._stopping.wait(self.POLL_S)


class _TailedFile:
    """One file ``ConsoleTail`` copies: where it has read to, and the line it has begun."""

    def __init__(self, path: str, prefix: str, stream: str) -> None:
        self.path = path
        self.prefix = prefix
        self.stream = stream
        self._file: BinaryIO | None = None
        self._pending = b""

    def copy(self, final: bool) -> None:
        """Write the whole lines that arrived since the last call (with ``final``, the rest
        too, and the file is done), in one write: a rank's lines stay together, and no one
        else's come in between."""
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 - open across calls
            except FileNotFoundError:
                return
        if self._file.closed:
            return
        data = self._pending + self._file.read()
        cut = data.rfind(b"\n") + 1
        if final or len(data) - cut >= ConsoleTail.LONGEST:
            cut = len(data)
        complete, self._pending = data[:cut], data[cut:]
        if final:
            self._file.close()
        if complete:
            text = complete.decode(errors="replace")
            lines = text.removesuffix("\n").split("\n")
            console = getattr(sys, self.stream)  # the one in use now (tests replace it)
            console.write("".join(f"{self.prefix}{line}\n" for line in lines))
            console.flush()


_TAIL: ContextVar[ConsoleTail | None] = ContextVar("mpt_console_tail", default=None)
"""The tail of the launch running in this context (``console_lines``)."""


@contextlib.contextmanager
def console_lines() -> Iterator[ConsoleTail]:
    """The span of a launch whose ranks' lines ``ConsoleLogs`` copies onto the console itself:
    when the span ends (after the workers have), every line is out, so what the caller prints
    next follows them. Without it, torch's agent copies them, and takes up to 0.1 s per stream
    to notice that it may stop."""
    tail = ConsoleTail()
    token = _TAIL.set(tail)
    try:
        yield tail
    finally:
        _TAIL.reset(token)
        tail.stop()


class RankLogs(LogsSpecs):
    """One file per global rank and attempt in ``log_dir``; the ``tee`` ranks also on the console.

    torch calls ``reify`` once per attempt (the first, and each restart of the gang) with every
    local worker's environment, just before it starts them.
    """

    def __init__(self, log_dir: Path, tee: frozenset[int] = DEFAULT_TEE) -> None:
        if log_dir.is_file():
            raise UsageError("--log-dir", log_dir, "it is a file",
                             "pass a directory (it is created if missing), or move the file away")
        super().__init__(log_dir=str(log_dir))
        self.log_dir = log_dir
        self.tee_ranks = tee
        self._archived = False  # earlier jobs' files are moved away once, before the first attempt

    @property
    def root_log_dir(self) -> str:
        return str(self.log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The files of this attempt, by local rank; puts ``MPT_LOG_FILE`` and torch's error file
        into each worker's environment."""
        if not envs:
            return LogsDest()
        some_env = next(iter(envs.values()))
        restart = int(some_env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        errors = self.log_dir / ".errors"
        try:
            errors.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError("--log-dir", self.log_dir, f"it cannot be created ({exc.strerror})",
                             "pass a directory this user can write to") from None
        ranks = {local: int(env["RANK"]) for local, env in envs.items()}
        if not self._archived:
            self._archived = True
            # Each node moves only the files no other node of this job touches: those of its own
            # ranks, and (node 0) those of ranks the job does not have. On a shared file system
            # a node must never move a file another node has just started to write.
            node0 = some_env.get("GROUP_RANK", "0") == "0"
            world_size = int(some_env.get("WORLD_SIZE", len(envs)))
            move_earlier_logs(self.log_dir, set(ranks.values()),
                              beyond=world_size if node0 else None)
        suffix = f".restart{restart}" if restart else ""
        dest = LogsDest()
        for local, rank in ranks.items():
            log = str(self.log_dir / f"rank{rank}{suffix}.log")
            # Only stdout goes to the file: stderr opened on it as well would be a second file
            # description with its own offset, and the two would overwrite each other. The worker
            # merges its stderr into its stdout instead (mpt.launchers.worker, MPT_LOG_FILE); until
            # it does, the interpreter's own errors (stderr "": inherited) reach the console.
            dest.stdouts[local], dest.stderrs[local] = log, ""
            envs[local][LOG_FILE] = log
            if rank in self.tee_ranks:
                dest.tee_stdouts[local] = log  # the agent tails it with the rank prefix
            # Read back by the agent when the worker fails (message, timestamp); written only by
            # scripts that use torch's ``@record``. One per attempt, so none is stale.
            error = str(errors / f"rank{rank}.restart{restart}.json")
            dest.error_files[local] = envs[local]["TORCHELASTIC_ERROR_FILE"] = error
        return dest

    def __repr__(self) -> str:
        return f"RankLogs(log_dir={str(self.log_dir)!r}, tee={sorted(self.tee_ranks)})"


def move_earlier_logs(log_dir: Path, ranks: set[int], beyond: int | None) -> Path | None:
    """Move an earlier job's files of ``ranks`` (and of every rank >= ``beyond``) from
    ``log_dir`` into ``log_dir/previous-<YYYYmmdd-HHMMSS>/``; the folder, or None if none.

    Moved, not deleted or truncated: the earlier job's logs may be all that is left of it.
    """

    def earlier(folder: Path) -> list[Path]:
        found = []
        for path in folder.glob("rank*") if folder.is_dir() else ():
            match = _LOG_NAME.fullmatch(path.name)
            if match and path.is_file():
                rank = int(match.group(1))
                if rank in ranks or (beyond is not None and rank >= beyond):
                    found.append(path)
        return found

    logs, errors = earlier(log_dir), earlier(log_dir / ".errors")
    if not logs and not errors:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = log_dir / f"previous-{stamp}", 1
    # Two jobs within one second: a new folder, never a file overwritten.
    while any((target / p.name).exists() for p in logs) or any(
            (target / ".errors" / p.name).exists() for p in errors):
        n += 1
        target = log_dir / f"previous-{stamp}-{n}"
    (target / ".errors" if errors else target).mkdir(parents=True, exist_ok=True)
    for path in logs:
        path.rename(target / path.name)
    for path in errors:
        path.rename(target / ".errors" / path.name)
    return target
