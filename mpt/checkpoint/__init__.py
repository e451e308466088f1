"""Checkpoints: one portable, atomic, amp-aware format, restorable under any backend and world size.

``save_checkpoint``/``load_checkpoint`` (used by ``rt.save``/``rt.load``) write and read mpt's
directory format (see ``mpt.checkpoint.format`` and ``docs/checkpoints.md``).

The names below are imported when first used: `mpt launch` checks ``--checkpoint-dir`` and
``--resume`` with ``mpt.checkpoint.io`` alone, before it starts any worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpt.lazy import lazy_attributes

if TYPE_CHECKING:
    from mpt.checkpoint.format import CheckpointError, Manifest
    from mpt.checkpoint.io import check_resume, check_root, find_latest
    from mpt.checkpoint.state import Stateful, TrainingState, load_checkpoint, save_checkpoint

_HOMES = {"CheckpointError": "format", "Manifest": "format", "check_resume": "io",
          "check_root": "io", "find_latest": "io", "Stateful": "state", "TrainingState": "state",
          "load_checkpoint": "state", "save_checkpoint": "state"}

__all__ = ["CheckpointError", "Manifest", "Stateful", "TrainingState", "check_resume", "check_root",
           "find_latest", "load_checkpoint", "save_checkpoint"]


__getattr__ = lazy_attributes(__name__, _HOMES)
