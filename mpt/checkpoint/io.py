"""Where checkpoints live: a local directory or any fsspec URL, written so a crash loses nothing.

A checkpoint *root* (the path given to ``rt.save``) holds one directory per save,
``step-000000100/``, a ``latest`` file naming the newest, and nothing else of mpt's. A save:

1. writes every file into ``.tmp-step-000000100-<id>/`` (local disks), fsyncing each;
2. writes ``manifest.json`` last: a directory without a readable manifest is never a checkpoint;
3. renames the directory to its final name and fsyncs the root (local disks; an object store
   has no rename, so there the files go straight to the final name and the manifest, written
   last, is the commit);
4. replaces ``latest`` (a temporary file renamed over it; one object put on a store);
5. deletes all but the newest ``keep`` checkpoints: renamed away first (or manifest deleted
   first), so a deletion cut short never leaves something that looks like a checkpoint.

A ``kill -9`` between any two of these leaves the previous checkpoint whole and ``latest``
naming it, or naming the new one once that is complete. A load of the root takes the newest
committed checkpoint, also one whose ``latest`` update a kill cut off.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mpt.checkpoint.format import MANIFEST, CheckpointError, Manifest
from mpt.errors import UsageError

LATEST = "latest"
_TMP, _TRASH = ".tmp-", ".trash-"


STEP_PREFIX = "step-"
"""How the folder of each checkpoint under a root begins (``step-000000042``)."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:09d}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Location:
    """A path on one fsspec filesystem; local paths keep the durability of fsync and rename."""

    fs: fsspec.AbstractFileSystem
    """The filesystem (``LocalFileSystem`` for plain paths and ``file://`` URLs)."""
    path: str
    """The path on ``fs``, without protocol."""
    url: str
    """How the user spelled it, for messages."""

    @classmethod
    def parse(cls, url: str | os.PathLike[str]) -> Location:
        text = os.fspath(url)
        fs, path = fsspec.core.url_to_fs(text)
        return cls(fs=fs, path=path.rstrip("/") or "/", url=text)

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def child(self, name: str) -> Location:
        return Location(fs=self.fs, path=posixpath.join(self.path, name),
                        url=posixpath.join(self.url.rstrip("/"), name))

    def exists(self, name: str = "") -> bool:
        return bool(self.fs.exists(self._join(name)))

    def _join(self, name: str) -> str:
        return posixpath.join(self.path, name) if name else self.path

    # -- reading ------------------------------------------------------------------------------
    def read(self, name: str) -> bytes:
        try:
            data: bytes = self.fs.cat_file(self._join(name))
        except FileNotFoundError:
            raise CheckpointError(f"{self.url}/{name}", "the file is missing",
                                  "load another checkpoint (e.g. an earlier step)") from None
        return data

    def local_path(self, name: str) -> str:
        """The path of child ``name`` on this machine (local locations only)."""
        return self._join(name)

    def listdir(self) -> list[str]:
        if not self.fs.isdir(self.path):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.path,
                                                                             detail=False))

    def manifest(self) -> Manifest:
        return Manifest.from_json(self.read(MANIFEST).decode(), self.url)

    # -- writing ------------------------------------------------------------------------------
    def makedirs(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def write(self, name: str, data: bytes | memoryview) -> None:
        """Write one file; on a local disk it is on the platter when this returns."""
        target = self._join(name)
        if not self.local:
            self.fs.pipe_file(target, data)
            return
        os.makedirs(posixpath.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    @contextmanager
    def open_write(self, name: str) -> Iterator[BinaryIO]:
        """A file to stream into; on a local disk it is on the platter when the block ends."""
        target = self._join(name)
        if not self.local:
            with self.fs.open(target, "wb") as f:
                yield f
            return
        os.makedirs(posixpath.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def fsync_tree(self) -> None:
        """fsync every file and directory below (files other ranks wrote, e.g. shards)."""
        if not self.local:
            return
        for dirpath, _, filenames in os.walk(self.path):
            for name in filenames:
                _fsync_path(os.path.join(dirpath, name), os.O_RDONLY)
            _fsync_path(dirpath, os.O_RDONLY)

    def replace_file(self, name: str, data: bytes) -> None:
        """Atomically give file ``name`` the content ``data``."""
        if not self.local:
            self.fs.pipe_file(self._join(name), data)  # one object put: atomic on stores
            return
        tmp = self._join(f"{_TMP}{name}-{uuid.uuid4().hex}")
        self.write(posixpath.basename(tmp), data)
        os.replace(tmp, self._join(name))
        _fsync_path(self.path, os.O_RDONLY)

    def remove(self, name: str) -> None:
        """Delete child ``name`` so that no moment of it looks like a checkpoint."""
        target = self._join(name)
        if self.local:
            trash = self._join(f"{_TRASH}{name}-{uuid.uuid4().hex}")
            os.rename(target, trash)
            _fsync_path(self.path, os.O_RDONLY)
            shutil.rmtree(trash, ignore_errors=True)
            return
        manifest = posixpath.join(target, MANIFEST)
        if self.fs.exists(manifest):
            self.fs.rm_file(manifest)
        self.fs.rm(target, recursive=True)

    def remove_leftovers(self) -> None:
        """Delete temporary and half-deleted directories an interrupted save left behind."""
        for name in self.listdir():
            if leftover(name):
                path = self._join(name)
                if self.local:
                    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else \
                        os.unlink(path)
                else:
                    self.fs.rm(path, recursive=True)


def leftover(name: str) -> bool:
    """Whether a root's child ``name`` is what an interrupted save or deletion left behind."""
    return name.startswith((_TMP, _TRASH))


def sync_directory(path: str) -> None:
    """fsync a local directory: the renames and deletions in it are durable."""
    _fsync_path(path, os.O_RDONLY)


def _fsync_path(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_name(step: int) -> str:
    """Where a save of ``step`` is written before it is committed (local disks)."""
    return f"{_TMP}{step_dir_name(step)}-{uuid.uuid4().hex[:12]}"


def commit(root: Location, staging: str, final: str) -> None:
    """Give the complete directory ``staging`` its final name, then point ``latest`` at it."""
    if root.local and staging != final:
        if root.exists(final):  # the same step saved again: the newer save wins
            root.remove(final)
        os.rename(root._join(staging), root._join(final))
        _fsync_path(root.path, os.O_RDONLY)
    root.replace_file(LATEST, final.encode())


def is_checkpoint(location: Location) -> bool:
    try:
        location.manifest()
    except CheckpointError:
        return False
    return True


def _saved_at(root: Location, names: Iterable[str]) -> list[tuple[float, str]]:
    """``(saved_at, name)`` of those of ``names`` that are committed checkpoints, oldest first."""
    found = []
    for name in names:
        try:
            found.append((root.child(name).manifest().saved_at, name))
        except CheckpointError:
            continue  # a directory an object-store save did not finish
    return sorted(found)


def complete_checkpoints(root: Location) -> list[tuple[float, str]]:
    """``(saved_at, name)`` of every committed checkpoint under ``root``, oldest first."""
    return _saved_at(root, (name for name in root.listdir() if name.startswith("step-")))


def prune(root: Location, keep: int, protect: str) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints (never ``protect``); return their names."""
    names = [name for _, name in complete_checkpoints(root) if name != protect]
    doomed = names[:max(len(names) - (keep - 1), 0)]
    for name in doomed:
        root.remove(name)
    root.remove_leftovers()
    return doomed


def find_latest(url: str | os.PathLike[str]) -> str | None:
    """The URL of the checkpoint ``resolve(url)`` would load, or None where there is none."""
    try:
        return resolve(url).url
    except CheckpointError:
        return None


def check_resume(argument: str, value: str | None) -> str:
    """A ``resume`` setting, checked: ``auto`` (the default), ``never``, or a checkpoint path
    (mpt's, or another framework's that ``mpt.checkpoint.foreign`` imports)."""
    if value in (None, "auto", "never"):
        return value or "auto"
    if find_latest(value) is None:
        from mpt.checkpoint import foreign  # it imports this module

        if not foreign.is_foreign(value):
            raise UsageError(argument, value, "no checkpoint there", "pass auto, never, a "
                             "directory rt.save wrote (a root or one step-N inside it), or "
                             f"{'; '.join(foreign.KNOWN)}")
    return value


def check_root(argument: str, value: str | os.PathLike[str] | None) -> str | None:
    """A checkpoint root (``--checkpoint-dir``), checked: a directory or a place for one, not
    a file (a save would fail only at its first checkpoint, after training for it)."""
    if value is None:
        return None
    location = Location.parse(value)
    if location.fs.isfile(location.path):
        raise UsageError(argument, os.fspath(value), "it is a file, not a directory",
                         "pass a directory (it is created if missing) or an fsspec URL of one")
    return os.fspath(value)


def resolve(url: str | os.PathLike[str]) -> Location:
    """The checkpoint directory ``url`` means: itself, the one its ``latest`` names (or a committed
    one saved after it), or else its newest complete one."""
    location = Location.parse(url)
    if location.exists(MANIFEST):
        return location
    if location.exists(LATEST):
        name = location.read(LATEST).decode().strip()
        try:
            saved_at = location.child(name).manifest().saved_at
        except CheckpointError:
            pass
        else:
            # A kill between a commit's rename and its `latest` update leaves a whole checkpoint
            # newer than the one `latest` names (one per such kill): take the newest, so no
            # committed step is lost. Only names after `latest` are read, and a higher step saved
            # earlier (an abandoned run resumed from an older step) stays behind `latest`.
            after = (n for n in location.listdir() if n.startswith("step-") and n > name)
            newer = [(t, n) for t, n in _saved_at(location, after) if t > saved_at]
            return location.child(max(newer)[1] if newer else name)
    found = complete_checkpoints(location)
    if found:
        return location.child(found[-1][1])
    what = "does not exist" if not location.exists() else "holds no complete checkpoint"
    raise CheckpointError(location.url, what, "pass a directory rt.save() wrote, or its root")

