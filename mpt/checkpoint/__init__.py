"""Checkpoints: one portable, atomic, amp-aware format, restorable under any backend and world size.

``save_checkpoint``/``load_checkpoint`` (used by ``rt.save``/``rt.load``) write and read mpt's
directory format (see ``mpt.checkpoint.format`` and ``docs/checkpoints.md``). ``save_state``/
``load_state`` below are the older single-file form, kept for small states of the user's own.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from mpt.checkpoint.format import CheckpointError, Manifest
from mpt.checkpoint.state import Stateful, TrainingState, load_checkpoint, save_checkpoint
from mpt.errors import UsageError

__all__ = ["CheckpointError", "Manifest", "Stateful", "TrainingState", "load_checkpoint",
           "load_state", "save_checkpoint", "save_state"]


def save_state(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` so that a crash mid-write leaves any previous file intact.

    The bytes go to a temporary file in the same directory, are fsynced, and replace ``path``
    in one ``os.replace``: a reader sees the old checkpoint or the new one, never half of one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by ``save_state``; tensors and plain containers only."""
    path = Path(path)
    if not path.is_file():
        raise UsageError("checkpoint", str(path), "no such file",
                         "pass the path a previous rt.save() wrote")
    # weights_only: a checkpoint is data, and unpickling arbitrary objects would run code.
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state
