"""Failure notes: when a rank's script ended with an error, with which code, and which rank.

``mpt.launchers.worker`` writes one per failed rank into ``$MPT_FAILURE_DIR``; the launchers
read them to name the rank that failed first (torch's and horovodrun's own reports often name
a peer that only failed because of it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class Note(NamedTuple):
    """What ``mpt.launchers.worker`` writes when a rank's script ends with an error."""

    failed_at: int
    """``time.time_ns()`` when the script ended."""
    exit_code: int
    """The code the script exited with."""
    rank: int = -1
    """The rank's global rank (-1: unknown)."""

    @classmethod
    def read(cls, path: Path) -> Note:
        return cls(*map(int, path.read_text().split()))

    def write(self, folder: str, pid: int) -> None:
        """Write whole, then rename: the launcher never reads half a note."""
        path = os.path.join(folder, str(pid))
        with open(path + ".tmp", "w") as out:
            out.write(f"{self.failed_at} {self.exit_code} {self.rank}")
        os.replace(path + ".tmp", path)

    @classmethod
    def read_all(cls, folder: str) -> dict[int, Note]:
        """The notes in ``folder``, by the pid of the process that wrote them."""
        return {int(p.name): cls.read(p) for p in Path(folder).iterdir() if p.name.isdigit()}
