"""A training state read from another framework's checkpoint, and its writing in mpt's format.

Every reader (DeepSpeed, torch.distributed.checkpoint, a torch.save file) returns one
``Imported``: the weights by name, the optimizer state in the by-name form mpt's own
checkpoints hold (``mpt.state.named``), the LR scheduler's state, the loss scale, the step and
epoch, and what the format does not hold. ``write`` commits it as an mpt checkpoint that
``rt.load``/``--resume`` restore under any backend and world size.

A reader may leave large tensors in the source's files (``OnDisk``: where their bytes lie):
``write`` streams each safetensors file, header first, then every tensor's bytes in key order,
a source's ranges copied a bounded piece at a time through short-lived read-only mappings, so
that what a conversion holds does not grow with the model (ZeRO's files, ``zero``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from queue import Queue
from typing import Any, BinaryIO, cast

import torch

from mpt.checkpoint import io, tensorfile
from mpt.checkpoint.encode import encode
from mpt.checkpoint.format import (
    CONVERTED,
    MODEL_FILE,
    STATE_JSON,
    STATE_TENSORS,
    FileEntry,
)
from mpt.checkpoint.state import write_directory
from mpt.precision import LossScaleState

MODEL = "model"
"""The name a one-model run gives its model (``rt.setup``'s default), under which the imported
weights, optimizer and scheduler are written."""
SCHEDULER = "scheduler"
"""The name ``rt.load(..., scheduler=sched)`` gives a single LR scheduler."""
NEVER_HELD = ("the data loader's position", "the RNG states")
"""What none of the imported formats holds in a form mpt can restore."""
Range = tuple[str, int, int]
"""A file, a byte offset in it and a byte count."""
_PIECE = 8 << 20
"""Bytes per mapping, write() and hash update (as ``tensorfile`` writes)."""
_DROP = 64 << 20
"""Bytes written between two ``POSIX_FADV_DONTNEED`` of what the file holds so far: the first
starts writing a range back to disk, a later one drops its pages, once clean, from the page
cache, so the next pieces reuse those pages. Taking ever more fresh pages (4 GiB of them for a
350 M-parameter state) cost most of a conversion's system time in a virtual machine."""
_AHEAD = 4
"""Pieces written but not yet hashed, at most, per file: with the one being written and the
one being hashed, what a file's writing holds of its sources."""


class OnDisk(torch.Tensor):
    """A tensor whose elements, in order, are the bytes of ``ranges`` (pieces of other files,
    e.g. every ZeRO rank's share of one parameter). It is a meta tensor (shape and dtype, no
    data), so every check of shapes and every step that only names tensors (``encode``, a
    safetensors header) takes it as it is; ``write`` copies its bytes from those files. Any
    other use of its values fails, as a meta tensor's does, rather than read them silently."""

    ranges: tuple[Range, ...]
    __torch_function__ = torch._C._disabled_torch_function_impl  # ops give plain meta tensors

    @staticmethod
    def of(shape: torch.Size, dtype: torch.dtype, ranges: Sequence[Range]) -> OnDisk:
        """The tensor of ``shape`` and ``dtype`` whose bytes are ``ranges``, which must add up
        to its size."""
        tensor = cast(OnDisk, torch.Tensor._make_subclass(
            OnDisk, torch.empty(shape, dtype=dtype, device="meta")))
        if sum(n for _, _, n in ranges) != tensor.numel() * dtype.itemsize:
            raise ValueError(f"{len(ranges)} ranges do not make a {dtype} tensor of {shape}")
        tensor.ranges = tuple(ranges)
        return tensor

    def detach(self) -> OnDisk:  # type: ignore[override]
        """Itself: ``encode`` keeps a tensor's ``detach()``, and this has nothing to detach."""
        return self


class Lazy(torch.Tensor):
    """A tensor a reader fetches from the source's files when asked, any box of it at a time.
    Like ``OnDisk`` it is a meta tensor (shape and dtype, no data) that checks and ``encode``
    take as it is; a subclass (``dcp.InChunks``) says where its values lie and reads them."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops give plain meta tensors

    def detach(self) -> Lazy:  # type: ignore[override]
        """Itself: ``encode`` keeps a tensor's ``detach()``, and this has nothing to detach."""
        return self

    def extents(self) -> tuple[Range, ...]:
        """The byte ranges of the source's files it may read (checked against their sizes)."""
        raise NotImplementedError

    def fill_box(self, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor,
                 fd: Callable[[str], int]) -> None:
        """``out`` (of ``sizes``) := the box of it at ``offsets``, read through ``fd`` (a
        file's path -> an open descriptor of it)."""
        raise NotImplementedError

    def whole(self, fd: Callable[[str], int] | None = None) -> torch.Tensor:
        """All of it, in memory (read through ``fd``, or files opened for this read)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        if out.numel() == 0:
            return out
        with Opened() as files:
            self.fill_box((0,) * out.dim(), tuple(out.shape), out, fd or files.fd)
        return out


class Opened(ExitStack):
    """Source files, each opened once (read-only) when first named, and closed together."""

    def __init__(self) -> None:
        super().__init__()
        self.fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        """An open descriptor of the file ``path``."""
        if path not in self.fds:
            self.fds[path] = self.enter_context(open(path, "rb")).fileno()  # noqa: SIM115
        return self.fds[path]


@dataclass(kw_only=True)
class Imported:
    """What a foreign checkpoint holds, in mpt's terms."""

    source: str
    """The format and how it was written, for messages (``DeepSpeed ZeRO-2, 2 ranks``)."""
    weights: dict[str, torch.Tensor]
    """Full weights and buffers by the model's own names (fp32 masters where it kept them)."""
    optimizer: dict[str, Any] | None = None
    """``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``, or None."""
    optimizer_kind: str | None = None
    """The torch optimizer class whose state it is (``AdamW``), where it can be told."""
    scheduler: dict[str, Any] | None = None
    """The LR scheduler's ``state_dict()``, or None."""
    loss_scale: LossScaleState | None = None
    """The dynamic loss scale, where the run scaled its loss."""
    precision: str = "fp32"
    """mpt's name of the precision it trained in (informative)."""
    step: int | None = None
    """The training step it was saved at, where it says."""
    epoch: int | None = None
    """The epoch it was saved at, where it says."""
    world_size: int = 1
    """Processes that wrote it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other plain values the script saved beside the state (returned by ``rt.load``)."""
    lacks: list[str] = field(default_factory=lambda: list(NEVER_HELD))
    """What it does not hold, said once at conversion."""

    @property
    def optimizer_held(self) -> str | None:
        """The optimizer state it holds, in words (``AdamW state of 4 parameters``)."""
        if self.optimizer is None:
            return None
        return (f"{self.optimizer_kind or 'optimizer'} state of "
                f"{len(self.optimizer['state'])} parameters")

    def describe(self) -> dict[str, Any]:
        """What it holds, as plain data (``mpt checkpoint inspect``)."""
        optimizer = self.optimizer_held or "none"
        return {"format": self.source, "step": self.step, "epoch": self.epoch,
                "world size": self.world_size, "precision": self.precision,
                "loss scale": 1.0 if self.loss_scale is None else self.loss_scale.scale,
                "parameters": sum(t.numel() for t in self.weights.values()),
                "tensors": len(self.weights), "optimizer": optimizer,
                "scheduler": self.scheduler is not None, "not in it": list(self.lacks)}

    def summary(self) -> str:
        """One line: what was imported."""
        parts = [f"{len(self.weights)} tensors"]
        if self.optimizer_held is not None:
            parts.append(self.optimizer_held)
        if self.scheduler is not None:
            parts.append("LR scheduler")
        if self.loss_scale is not None:
            parts.append(f"loss scale {self.loss_scale.scale:g}")
        return ", ".join(parts)


def as_int(value: Any) -> int | None:
    """A step or epoch a script saved (an int, or a one-element tensor); None otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return int(value.item())
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write(imported: Imported, dst: str | os.PathLike[str], *, step: int,
          source_path: str) -> str:
    """Commit ``imported`` as the mpt checkpoint ``dst/step-<step>/`` (atomically, as
    ``rt.save`` does); return its URL."""
    tensors: dict[str, Any] = {}
    state = state_json(imported, tensors, source_path=source_path)
    blobs: dict[str, Any] = {MODEL_FILE: model_tensors(imported),
                             STATE_TENSORS: tensors, STATE_JSON: json.dumps(state).encode()}
    root = io.Location.parse(dst)
    root.makedirs()
    final = io.step_dir_name(step)
    staging = io.staging_name(step) if root.local else final
    write_directory(root, staging, final, blobs, tensors=_stream,
                    manifest=manifest_fields(imported, step=step))
    return root.child(final).url


def state_json(imported: Imported, tensors: dict[str, Any], *, source_path: str
               ) -> dict[str, Any]:
    """The ``state.json`` of ``imported`` as an mpt checkpoint, its tensors (optimizer,
    scheduler, loss scaler) put into ``tensors`` by key (``encode``)."""
    precision: dict[str, Any] = {"skipped_steps": 0}
    if imported.loss_scale is not None:
        precision["scaler"] = imported.loss_scale.state_dict()
    optimizers = {} if imported.optimizer is None else {
        MODEL: encode(imported.optimizer, f"optimizer/{MODEL}", tensors)}
    schedulers = {} if imported.scheduler is None else {
        SCHEDULER: encode(imported.scheduler, f"scheduler/{SCHEDULER}", tensors)}
    extra = {**imported.extra, "converted_from": source_path}
    return {"models": [MODEL], "optimizers": optimizers,
            "precision": encode(precision, "precision", tensors), "schedulers": schedulers,
            "loaders": {}, "rng": [], "extra": encode(extra, "extra", tensors),
            # what load_checkpoint checks against the run it restores into
            "imported": {"source": imported.source, "optimizers": {
                MODEL: imported.optimizer_kind} if imported.optimizer_kind else {}}}


def model_tensors(imported: Imported) -> dict[str, torch.Tensor]:
    """The weights by checkpoint key (``model/<name>``)."""
    return {f"{MODEL}/{k}": v for k, v in imported.weights.items()}


def manifest_fields(imported: Imported, *, step: int) -> dict[str, Any]:
    """The manifest's fields that describe ``imported`` (``write_directory`` adds the rest)."""
    return dict(backend=CONVERTED, world_size=imported.world_size, step=step,
                epoch=imported.epoch, sharded=False, precision=imported.precision,
                loss_scale=1.0 if imported.loss_scale is None else imported.loss_scale.scale,
                parameters=sum(t.numel() for t in imported.weights.values()))


def _stream(f: BinaryIO, tensors: dict[str, torch.Tensor]) -> FileEntry:
    """Write ``tensors`` to ``f`` as ``tensorfile.write`` does (the same safetensors bytes),
    an ``OnDisk`` tensor's bytes copied from its files; return the size and sha256. A second
    thread hashes each piece once it is written, up to ``_AHEAD`` pieces behind."""
    ordered = {name: t if isinstance(t, OnDisk | Lazy) else t.detach().to("cpu").contiguous()
               for name, t in sorted(tensors.items())}
    sha = hashlib.sha256()
    written: Queue[_Piece | None] = Queue(maxsize=_AHEAD)

    def hash_all() -> None:
        while (piece := written.get()) is not None:
            sha.update(piece.view)
            piece.close()

    size = dropped = 0
    fd = _fileno(f)
    hasher = threading.Thread(target=hash_all)
    hasher.start()
    try:
        with Opened() as files:
            for piece in _pieces(ordered, files):
                f.write(piece.view)
                size += len(piece.view)
                written.put(piece)
                if fd is not None and size - dropped >= _DROP:
                    f.flush()
                    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
                    dropped = size
    finally:
        written.put(None)
        hasher.join()
    return FileEntry(sha256=sha.hexdigest(), bytes=size)


def _fileno(f: BinaryIO) -> int | None:
    """The descriptor of a local file, for ``posix_fadvise``; None for a remote one."""
    try:
        return f.fileno()
    except (OSError, AttributeError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


class _Piece:
    """Bytes to write and hash: a tensor's memory, or a read-only mapping of a source's range,
    unmapped once hashed so that its pages leave the process's memory."""

    def __init__(self, view: memoryview, mapping: mmap.mmap | None = None, *,
                 whole: memoryview | None = None, owner: torch.Tensor | None = None) -> None:
        self.view = view
        self.mapping = mapping
        self.whole = whole
        """The view of the whole mapping ``view`` is cut from: released too before unmapping."""
        self.owner = owner
        """The tensor whose memory ``view`` is, where nothing else keeps it (a ``Lazy``
        tensor read for the write): kept until its piece is hashed."""

    def close(self) -> None:
        self.view.release()
        if self.whole is not None:
            self.whole.release()
        if self.mapping is not None:
            self.mapping.close()
        self.owner = None


def _pieces(ordered: dict[str, torch.Tensor], files: Opened) -> Iterator[_Piece]:
    """The safetensors file of ``ordered`` (CPU, ``OnDisk`` or ``Lazy`` tensors, in key
    order), piece by piece; the sources' files are opened once, on ``files``; a ``Lazy``
    tensor is read whole in its turn and let go once written."""
    yield _Piece(memoryview(tensorfile.header(ordered)))
    for tensor in ordered.values():
        owner = None
        if isinstance(tensor, Lazy):
            tensor = owner = tensor.whole(files.fd)
        if not isinstance(tensor, OnDisk):
            raw = tensorfile.raw_bytes(tensor)
            for at in range(0, len(raw), _PIECE):
                yield _Piece(raw[at:at + _PIECE], owner=owner)
            continue
        for path, offset, count in tensor.ranges:
            for at in range(offset, offset + count, _PIECE):
                yield _mapped(files.fd(path), at, min(_PIECE, offset + count - at))


def _mapped(fd: int, offset: int, count: int) -> _Piece:
    """``count`` bytes of the file ``fd`` from ``offset``, mapped read-only (its pages, in the
    page cache already after a save, are shared, not copied)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, offset + count - start, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                        prot=mmap.PROT_READ, offset=start)
    whole = memoryview(mapping)
    return _Piece(whole[offset - start:], mapping, whole=whole)
