"""What a checkpoint directory holds, and how its contents are checked before they are used.

A checkpoint is a directory of plain files: ``model.safetensors`` (full weights of every model
set up, keyed ``<model name>/<parameter name>``), ``state.safetensors`` + ``state.json``
(optimizer states by model name, keyed by parameter name, precision, LR schedulers by name,
sampler positions, every rank's RNG, user extras: tensors in the first, everything else in the
second) and ``manifest.json``, written last, which lists every other file with its size and
sha256. Nothing in it is pickled, so reading it never runs code.

An in-memory snapshot (``--snapshot-every``) lists crc32 instead of sha256: its files never
leave the job's memory, where the check is against a torn or damaged copy, not tampering, and
crc32 costs a third of sha256's time per byte. The manifest names which one each file has;
checkpoints on disk keep sha256.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from mpt.errors import CheckpointError

FORMAT_VERSION = 2
"""2: several models by name (``<name>/<parameter>`` keys, optimizers and schedulers by name);
1: one model with unprefixed keys, still read."""
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
STATE_TENSORS = "state.safetensors"
STATE_JSON = "state.json"
SHARDED_DIR = "sharded"
"""Subdirectory of torch.distributed.checkpoint's per-rank safetensors shards."""
CONVERTED = "converted"
"""The manifest's ``backend`` of a checkpoint imported from another framework."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FileEntry:
    """One file of a checkpoint, as the manifest records it."""

    bytes: int
    """Size; a truncated file is named by this before its hash is even computed."""
    sha256: str | None = None
    """Hex digest of the file's bytes: a changed byte anywhere is refused at load."""
    crc32: str | None = None
    """The file's CRC-32 in hex, in place of ``sha256`` (in-memory snapshots only)."""

    @property
    def algorithm(self) -> str:
        """The checksum the manifest keeps for this file: ``sha256`` or ``crc32``."""
        return "sha256" if self.sha256 is not None or self.crc32 is None else "crc32"

    @property
    def expected(self) -> str | None:
        return self.sha256 if self.algorithm == "sha256" else self.crc32

    def as_dict(self) -> dict[str, Any]:
        """The manifest's entry: the checksum the file has, not the other one's null."""
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """The checkpoint's table of contents, written after every other file (the commit mark)."""

    format: int
    """``FORMAT_VERSION`` of the writer; a newer one than this mpt knows is refused."""
    mpt_version: str
    """mpt's version that wrote it (informative)."""
    backend: str
    """Backend of the run that saved (informative: any backend can load it)."""
    world_size: int
    """Processes of the run that saved (informative: any world size can load it)."""
    precision: str
    """``--precision`` of the run that saved."""
    step: int
    """The training step the user passed to ``save``."""
    epoch: int | None
    """The epoch the user passed, or the first loader's epoch."""
    saved_at: float
    """Unix time of the save; keep-last-k and the fallback for a lost ``latest`` order by it."""
    sharded: bool
    """Model and optimizer tensors are in ``sharded/`` (torch.distributed.checkpoint)."""
    parameters: int
    """Number of model parameters (elements), for ``mpt checkpoint inspect``."""
    loss_scale: float
    """The precision's loss scale at the save (1.0 without scaling)."""
    files: dict[str, FileEntry] = field(default_factory=dict)
    """Every other file of the checkpoint, by path relative to its directory."""

    def to_json(self) -> str:
        return json.dumps(manifest_dict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format", 0) > FORMAT_VERSION:
                raise CheckpointError(where, f"format {raw['format']} is newer than this mpt "
                                      f"reads ({FORMAT_VERSION})", "upgrade mpt")
            raw["files"] = {name: FileEntry(**entry) for name, entry in raw["files"].items()}
            return cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"{where}/{MANIFEST}", f"the manifest is unreadable ({exc})",
                                  "load another checkpoint; this one was not written completely "
                                  "or was edited") from None


def digest(data: bytes | memoryview, algorithm: str = "sha256") -> str:
    """Hex checksum of ``data``: ``sha256`` or ``crc32`` (``FileEntry.algorithm``)."""
    if algorithm == "crc32":
        return crc32_hex(zlib.crc32(data))
    return hashlib.sha256(data).hexdigest()


def crc32_hex(value: int) -> str:
    return f"{value:08x}"


def verify(where: str, name: str, data: bytes, entry: FileEntry | None) -> bytes:
    """``data`` if it is the file the manifest lists as ``name``; a CheckpointError if not."""
    check(where, name, len(data), lambda algorithm: digest(data, algorithm), entry)
    return data


def check(where: str, name: str, size: int, hash_of: Callable[[str], str],
          entry: FileEntry | None) -> None:
    """Refuse file ``name`` of ``size`` bytes unless the manifest lists it with that size and
    the checksum ``hash_of(entry.algorithm)`` returns (called only when the size matches)."""
    if entry is None:
        raise CheckpointError(f"{where}/{name}", "the manifest does not list this file",
                              "load a checkpoint written by mpt.Runtime.save")
    algorithm, expected = entry.algorithm, entry.expected
    if expected is None:
        raise CheckpointError(f"{where}/{name}", "the manifest records no checksum for it",
                              "load a checkpoint written by mpt.Runtime.save")
    if size != entry.bytes:
        raise CheckpointError(f"{where}/{name}", f"it has {size} bytes, the manifest says "
                              f"{entry.bytes} ({algorithm} {expected}): truncated or replaced",
                              "load another checkpoint (e.g. an earlier step)")
    got = hash_of(algorithm)
    if got != expected:
        raise CheckpointError(f"{where}/{name}", f"{algorithm} {got} does not match the "
                              f"manifest's {expected}: the file was corrupted or edited",
                              "load another checkpoint (e.g. an earlier step)")


def entry_for(data: bytes) -> FileEntry:
    return FileEntry(sha256=digest(data), bytes=len(data))


def manifest_dict(manifest: Manifest) -> dict[str, Any]:
    """The manifest as plain data (for ``mpt checkpoint inspect --json``)."""
    return {**asdict(manifest), "files": {name: entry.as_dict()
                                          for name, entry in manifest.files.items()}}
