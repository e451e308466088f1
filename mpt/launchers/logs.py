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
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, LogsSpecs

from mpt.environments.settings import LOG_FILE
from mpt.errors import UsageError

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
    """Where the workers' output goes: ``RankLogs`` with a log dir; without one, torch's
    default, which leaves every rank's stdout and stderr on the console as they are."""
    return DefaultLogsSpecs() if log_dir is None else RankLogs(log_dir, tee)


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
