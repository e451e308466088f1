"""horovodrun's output shown as `mpt launch` shows its workers', and its own command line read.

horovodrun relays every line a rank writes as ``[R]<stdout>:line`` (or ``<stderr>``), on its own
stdout and stderr, from every host. With ``--log-dir D``, ``RankOutput`` writes each rank's lines
into ``D/rank<R>.log`` (stdout and stderr in the order they arrived, like the elastic launcher's
files), shows only the ``--tee`` ranks on the console, prefixed ``[rank<R>]: `` as there, and
keeps horovodrun's own lines in ``D/horovodrun.log``. Without a log dir the ranks' lines pass
through as horovodrun wrote them, and horovodrun's own lines (its per-process report of a
failure: 20-30 lines after mpt's one error) are held back: they reach the console only where no
rank wrote a line (horovodrun could not start them: a host it cannot reach, say), since
otherwise mpt's own summary of a failure says which rank failed and how.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mpt.launchers.local_rank import LOCAL_RANK_ARG
from mpt.launchers.logs import DEFAULT_TEE, move_earlier_logs

RANK_LINE = re.compile(r"[^\[\n]*\[(\d+)\]<(?:stdout|stderr)>:(.*)", re.DOTALL)
"""A line horovodrun relays from a rank (after an optional timestamp)."""

SHELL_REPORTS = frozenset({"Terminated", "Killed"})
"""What the shell horovodrun starts each rank in (``sh -c``) writes on the rank's stderr when
horovodrun stops the rank with a signal after another failed: horovodrun's words, not the
rank's, so they go with horovodrun's own lines."""

HOROVODRUN_LOG = "horovodrun.log"
"""horovodrun's own lines (not a rank's), under ``--log-dir``."""

_PYTHON = re.compile(r"python[\d.]*")
_PYTHON_FLAGS = frozenset({"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-b", "-bb"})


class RankOutput:
    """Where each line horovodrun writes goes: see the module docstring."""

    def __init__(self, log_dir: Path | None, tee: frozenset[int] = DEFAULT_TEE,
                 world_size: int | None = None) -> None:
        self.log_dir = log_dir
        self.tee = tee
        self._files: dict[int | None, TextIO] = {}
        self._lock = threading.Lock()
        self._held: list[tuple[str, TextIO]] = []
        """horovodrun's own lines, without a log dir, with the stream each was written on."""
        self._ranks_spoke = False
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            # An earlier job's files move aside (all of them when the world size is unknown),
            # horovodrun's own log with them.
            moved = move_earlier_logs(log_dir, set(range(world_size or 0)),
                                      beyond=world_size or 0)
            previous = log_dir / HOROVODRUN_LOG
            if previous.exists():
                previous.rename((moved or log_dir) / (HOROVODRUN_LOG if moved
                                                      else f"{HOROVODRUN_LOG}.previous"))

    def write(self, line: str, console: TextIO) -> None:
        """One line (with its newline) that horovodrun wrote on ``console``'s stream."""
        found = RANK_LINE.fullmatch(line)
        if found is not None and found.group(2).strip() in SHELL_REPORTS:
            found = None
        if self.log_dir is None:
            if found is None:
                with self._lock:
                    self._held.append((line, console))
                return
            self._ranks_spoke = True
            console.write(line)
            console.flush()
            return
        rank = int(found.group(1)) if found else None
        text = found.group(2) if found else line
        with self._lock:
            if rank not in self._files:
                name = HOROVODRUN_LOG if rank is None else f"rank{rank}.log"
                self._files[rank] = open(self.log_dir / name, "a", buffering=1)  # noqa: SIM115
            self._files[rank].write(text)
            if rank is not None and rank in self.tee:
                sys.stdout.write(f"[rank{rank}]: {text}")
                sys.stdout.flush()

    def close(self) -> None:
        """Close the log files; without a log dir, show horovodrun's own lines if no rank
        spoke (then they are all there is to read)."""
        with self._lock:
            for file in self._files.values():
                file.close()
            self._files.clear()
            for line, console in self._held if not self._ranks_spoke else ():
                console.write(line)
                console.flush()
            self._held.clear()


def pump(stream: TextIO, output: RankOutput, console: TextIO,
         tail: list[str] | None = None) -> None:
    """Copy ``stream`` line by line into ``output``; keep its last lines in ``tail``."""
    for line in stream:
        output.write(line, console)
        if tail is not None:
            tail[:] = [*tail[-20:], line]


def start_pump(stream: TextIO, output: RankOutput, console: TextIO) -> threading.Thread:
    thread = threading.Thread(target=pump, args=(stream, output, console), daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True, slots=True)
class HorovodrunArgs:
    """What `mpt horovodrun` needs from horovodrun's own arguments."""

    processes: int | None
    """``-np``: the job's processes (None: not given)."""
    per_host: int | None
    """The most processes any one host runs (None: unknown, e.g. a hostfile)."""
    command: int | None
    """Index of the Python interpreter that starts the script (None: not a Python script)."""


def _value(args: Sequence[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(f"{name}="):
                return arg.split("=", 1)[1]
    return None


def read_args(args: Sequence[str]) -> HorovodrunArgs:
    """``-np``, the processes per host of ``-H``, and where ``python SCRIPT`` starts."""
    command = next((i for i, arg in enumerate(args)
                    if _PYTHON.fullmatch(os.path.basename(arg)) or arg == sys.executable), None)
    options = args if command is None else args[:command]
    np_value = _value(options, ("-np", "--num-proc"))
    processes = int(np_value) if np_value and np_value.isdigit() else None
    hosts = _value(options, ("-H", "--hosts"))
    per_host: int | None = processes if hosts is None and "--hostfile" not in options else None
    if hosts:
        slots = [h.partition(":")[2] for h in hosts.split(",")]
        per_host = max((int(s) if s.isdigit() else 1) for s in slots)
    if command is not None:
        _, rest = _split_flags(args[command + 1:])
        if not rest or rest[0].startswith("-"):  # python -m module, python -c ...: not a script
            command = None
    return HorovodrunArgs(processes=processes, per_host=per_host, command=command)


def through_worker(args: Sequence[str], command: int, local_rank_arg: bool = False) -> list[str]:
    """``args`` with ``python [flags] SCRIPT ...`` run through mpt's worker shim, which notes
    how each rank ended (the failure report) and can pass ``--local_rank``."""
    flags, rest = _split_flags(args[command + 1:])
    worker = ["-u", "-m", "mpt.launchers.worker", *([LOCAL_RANK_ARG] if local_rank_arg else [])]
    return [*args[:command], args[command], *[f for f in flags if f != "-u"], *worker, *rest]


def _split_flags(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """The interpreter's own leading flags (``-u``, ``-O``, ...) and what follows them."""
    n = 0
    while n < len(args) and args[n] in _PYTHON_FLAGS:
        n += 1
    return list(args[:n]), list(args[n:])
