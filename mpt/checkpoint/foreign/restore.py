"""An imported training state restored into the run as it is, without an mpt copy on disk.

``rt.load``/``--resume`` of another framework's checkpoint gives ``state.restore`` the
``Imported`` laid out as an mpt checkpoint's contents (the same keys and ``state.json`` that
``imported.write`` would commit), so that every check and every step of the restore is the one
an mpt checkpoint gets. Where the run's ranks hold pieces of the state (``shards_state``: fsdp's
shards, ZeRO's flat ranges, a pipeline's stages), each rank materialises only what it would read
of a sharded mpt checkpoint (``held.rank_reads``): its pieces, copied in place from the source,
and whole only the small rest; another stage's tensors stay unread. An ``imported.OnDisk``
tensor (ZeRO's partitions) is read from its files with plain reads of just the bytes a piece
needs, straight into that piece; an ``imported.Lazy`` one (DCP's chunks) reads just the chunks
that overlap the piece; a tensor the reader holds (a memory-mapped torch file's) is sliced.
Elsewhere (every rank holds the whole state) each tensor is read whole, one at a time.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from typing import Any

import torch

from mpt.checkpoint import io
from mpt.checkpoint.contents import Contents
from mpt.checkpoint.foreign.imported import (
    Imported,
    Lazy,
    OnDisk,
    Opened,
    manifest_fields,
    model_tensors,
    state_json,
)
from mpt.checkpoint.format import FORMAT_VERSION, CheckpointError, Manifest
from mpt.checkpoint.held import rank_reads
from mpt.checkpoint.sharded import Unread
from mpt.checkpoint.state import TrainingState, mpt_version, restore
from mpt.errors import UsageError
from mpt.state.flat import FlatPiece

_SHARDED = ("model/", "optimizer/")
"""The keys a sharded mpt checkpoint keeps in its shards (read in part); the rest (precision,
schedulers, extra values) every rank reads whole."""


def load(imported: Imported, parts: TrainingState, src: str) -> dict[str, Any]:
    """Collective: restore ``imported`` (read from ``src``) into the run's live objects;
    return what ``load_checkpoint`` returns."""
    step = imported.step or 0
    tensors: dict[str, Any] = {}
    state = state_json(imported, tensors, source_path=src)
    stored = {**{f"model/{k}": t for k, t in model_tensors(imported).items()}, **tensors}
    with _Files() as files, torch.no_grad():  # pieces are the live parameters' memory
        files.check(stored.values())  # a short file is refused alike on every rank, up front
        if parts.backend.shards_state:
            wanted = rank_reads(parts, state)
            whole = None if wanted.whole is None else set(wanted.whole)
            local = set(wanted.into) | (whole or set())
            read: dict[str, Any] = {}
            for key, t in stored.items():
                if key in wanted.into:
                    read[key] = files.fill(key, wanted.into[key], t, src)
                elif (not key.startswith(_SHARDED) or whole is None or key in whole
                      or (key.startswith("model/") and key not in local)):
                    # ... and weights the run does not have: whole, for the restore to refuse
                    read[key] = files.whole(t)
                else:  # state of parameters another pipeline stage holds
                    read[key] = Unread(key, src)
        else:
            read = {key: files.whole(t) for key, t in stored.items()}
    manifest = Manifest(format=FORMAT_VERSION, mpt_version=mpt_version(), saved_at=time.time(),
                        **manifest_fields(imported, step=step))
    contents = Contents(location=io.Location.parse(src), manifest=manifest,
                        model={k.removeprefix("model/"): t for k, t in read.items()
                               if k.startswith("model/")},
                        tensors={k: t for k, t in read.items() if not k.startswith("model/")},
                        state=state)
    return restore(src, contents, parts)


class _Files(Opened):
    """The source files ``OnDisk`` and ``Lazy`` tensors lie in, each opened once, and the
    reads from them."""

    def check(self, tensors: Any) -> None:
        """Refuse an ``OnDisk`` or ``Lazy`` tensor whose bytes lie past the end of its file."""
        sizes: dict[str, int] = {}
        for t in tensors:
            ranges = t.ranges if isinstance(t, OnDisk) else t.extents() if isinstance(
                t, Lazy) else ()
            for path, offset, count in ranges:
                if path not in sizes:
                    sizes[path] = os.fstat(self.fd(path)).st_size
                if offset + count > sizes[path]:
                    raise UsageError("SRC", path, f"it ends at byte {sizes[path]}, before a "
                                     f"tensor's bytes {offset} to {offset + count}", "pass the "
                                     "checkpoint as the framework wrote it, complete")

    def whole(self, t: Any) -> Any:
        """``t`` as a tensor in memory (an ``OnDisk`` or ``Lazy`` one read)."""
        if isinstance(t, Lazy):
            return t.whole(self.fd)
        if not isinstance(t, OnDisk):
            return t
        out = torch.empty(t.shape, dtype=t.dtype)
        self.read(t, 0, out.view(-1))
        return out

    def fill(self, key: str, piece: Any, t: Any, src: str) -> Any:
        """Copy this rank's part of ``t`` into ``piece`` (a ``DTensor`` or ``FlatPiece``,
        ``held.local_state``'s), in place; return ``piece``."""
        if tuple(piece.shape) != tuple(t.shape):
            raise CheckpointError(src, f"it holds {key} as {tuple(t.shape)}, this run has "
                                  f"{tuple(piece.shape)}", "load it into the model it was "
                                  "saved from")
        if isinstance(piece, FlatPiece):
            self.copy_range(t, piece.start, piece.flat.detach())
            return piece
        local = piece.to_local().detach()
        for chunk in piece.__create_chunk_list__():  # one box: this rank's shard
            if local.numel():
                self.copy_box(t, tuple(chunk.offsets), tuple(chunk.sizes), local)
        return piece

    def copy_range(self, t: Any, start: int, out: torch.Tensor) -> None:
        """``out`` (1-D) := elements ``start`` on of ``t`` flattened."""
        if isinstance(t, Lazy):
            self.copy_lazy_range(t, start, out)
        elif not isinstance(t, OnDisk):
            out.copy_(t.reshape(-1)[start:start + out.numel()])
        elif out.dtype == t.dtype and out.is_contiguous():
            self.read(t, start, out)
        else:
            buffer = torch.empty(out.numel(), dtype=t.dtype)
            self.read(t, start, buffer)
            out.copy_(buffer)

    def copy_lazy_range(self, t: Lazy, start: int, out: torch.Tensor) -> None:
        """``copy_range`` of a ``Lazy`` tensor: the box of whole rows (along the first
        dimension) that holds the range is read, then the range is copied out of it."""
        if out.numel() == 0:
            return
        if t.dim() == 0:
            out.copy_(t.whole(self.fd).reshape(-1)[start:start + out.numel()])
            return
        row = math.prod(t.shape[1:])
        first, last = start // row, -(-(start + out.numel()) // row)
        rows = torch.empty((last - first, *t.shape[1:]), dtype=t.dtype)
        t.fill_box((first,) + (0,) * (t.dim() - 1), tuple(rows.shape), rows, self.fd)
        at = start - first * row
        out.copy_(rows.view(-1)[at:at + out.numel()])

    def copy_box(self, t: Any, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor) -> None:
        """``out`` (of ``sizes``) := the box of ``t`` at ``offsets``."""
        if isinstance(t, Lazy):
            t.fill_box(offsets, sizes, out, self.fd)
            return
        if not isinstance(t, OnDisk):
            box = t
            for dim, (at, n) in enumerate(zip(offsets, sizes, strict=True)):
                box = box.narrow(dim, at, n)
            out.copy_(box)
            return
        into = out if out.dtype == t.dtype and out.is_contiguous() else torch.empty(
            sizes, dtype=t.dtype)
        flat, done = into.view(-1), 0
        for start, count in _runs(tuple(t.shape), offsets, sizes):
            self.read(t, start, flat[done:done + count])
            done += count
        if into is not out:
            out.copy_(into)

    def read(self, t: OnDisk, start: int, out: torch.Tensor) -> None:
        """``out`` (contiguous, 1-D, ``t``'s dtype) := elements ``start`` on of ``t``, read
        from its files straight into ``out``'s memory."""
        size = t.dtype.itemsize
        low, high = start * size, (start + out.numel()) * size
        if low == high:
            return
        view = memoryview(out.detach().view(torch.uint8).numpy())
        at = 0  # where each range starts in the tensor's bytes
        for path, offset, count in t.ranges:
            first, last = max(low, at), min(high, at + count)
            if first < last:
                _pread(self.fd(path), view[first - low:last - low], offset + first - at, path)
            at += count


def _pread(fd: int, into: memoryview, offset: int, path: str) -> None:
    """Fill ``into`` with the bytes of ``fd`` from ``offset``."""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            raise UsageError("SRC", path, f"it ends before byte {offset + len(into)}", "pass "
                             "the checkpoint as the framework wrote it, complete")
        done += n


def _runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
          ) -> list[tuple[int, int]]:
    """The box of ``sizes`` at ``offsets`` in a tensor of ``shape``, as runs of consecutive
    elements of the flattened tensor (first element, count), in the box's row-major order: one
    run for a box of whole rows (a shard along the first dimension)."""
    if not shape:
        return [(0, 1)]
    cut = max((d for d in range(len(shape)) if sizes[d] != shape[d]), default=0)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    count = sizes[cut] * strides[cut]
    outer = itertools.product(*(range(offsets[d], offsets[d] + sizes[d]) for d in range(cut)))
    return [(sum(i * strides[d] for d, i in enumerate(index)) + offsets[cut] * strides[cut],
             count) for index in outer]
