"""Checkpoints: one portable, atomic, amp-aware format, restorable under any backend and world size.

``save_checkpoint``/``load_checkpoint`` (used by ``rt.save``/``rt.load``) write and read mpt's
directory format (see ``mpt.checkpoint.format`` and ``docs/checkpoints.md``).
"""

from __future__ import annotations

from mpt.checkpoint.format import CheckpointError, Manifest
from mpt.checkpoint.io import check_resume, check_root, find_latest
from mpt.checkpoint.state import Stateful, TrainingState, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "Manifest", "Stateful", "TrainingState", "check_resume", "check_root",
           "find_latest", "load_checkpoint", "save_checkpoint"]
