"""An imported training state restored into the run as it is, without an mpt copy on disk.

``rt.load``/``--resume`` of another framework's checkpoint gives ``state.restore`` the
``Imported`` laid out as an mpt checkpoint's contents (the same keys and ``state.json`` that
``imported.write`` would commit), so that every check and every step of the restore is the one
an mpt checkpoint gets. Where the run's ranks hold pieces of the state (``shards_state``: fsdp's
shards, ZeRO's flat ranges, a pipeline's stages), each rank materialises only what it would read
of a sharded mpt checkpoint (``held.rank_reads``): its pieces, copied in place from the source,
and whole only the small rest; another stage's tensors stay unread. An ``imported.Lazy``
tensor reads only what a piece needs (``OnDisk``, ZeRO's partitions: plain reads of just its
bytes, straight into the piece; ``dcp.InChunks``: the chunks that overlap it); a tensor the
reader holds (a memory-mapped torch file's) is sliced.
Elsewhere (every rank holds the whole state) each tensor is read whole, one at a time.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from mpt.checkpoint import io
from mpt.checkpoint.contents import Contents
from mpt.checkpoint.foreign.imported import (
    Imported,
    Lazy,
    Opened,
    manifest_fields,
    model_tensors,
    state_json,
)
from mpt.checkpoint.format import FORMAT_VERSION, CheckpointError, Manifest
from mpt.checkpoint.held import gather_object, rank_reads
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
            # the weights some rank holds (another pipeline stage's are left to their ranks)
            held = {key for keys in gather_object(parts.backend, sorted(
                key for key in {*wanted.into, *(whole or ())} if key.startswith("model/")))
                for key in keys}
            read: dict[str, Any] = {}
            for key, t in stored.items():
                if key in wanted.into:
                    read[key] = files.fill(key, wanted.into[key], t, src)
                elif (not key.startswith(_SHARDED) or whole is None or key in whole
                      or (key.startswith("model/") and key not in held)):
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
    """The source files ``Lazy`` tensors lie in, each opened once, and the reads from them."""

    def check(self, tensors: Any) -> None:
        """Refuse a ``Lazy`` tensor whose bytes lie past the end of its file."""
        sizes: dict[str, int] = {}
        for t in tensors:
            for path, offset, count in t.extents() if isinstance(t, Lazy) else ():
                if path not in sizes:
                    sizes[path] = os.fstat(self.fd(path)).st_size
                if offset + count > sizes[path]:
                    raise UsageError("SRC", path, f"it ends at byte {sizes[path]}, before a "
                                     f"tensor's bytes {offset} to {offset + count}", "pass the "
                                     "checkpoint as the framework wrote it, complete")

    def whole(self, t: Any) -> Any:
        """``t`` as a tensor in memory (a ``Lazy`` one read)."""
        return t.whole(self.fd) if isinstance(t, Lazy) else t

    def fill(self, key: str, piece: Any, t: Any, src: str) -> Any:
        """Copy this rank's part of ``t`` into ``piece`` (a ``DTensor`` or ``FlatPiece``,
        ``held.local_state``'s), in place; return ``piece``."""
        if tuple(piece.shape) != tuple(t.shape):
            raise CheckpointError(src, f"it holds {key} as {tuple(t.shape)}, this run has "
                                  f"{tuple(piece.shape)}", "load it into the model it was "
                                  "saved from")
        if isinstance(piece, FlatPiece):
            out = piece.flat.detach()
            if isinstance(t, Lazy):
                t.fill_range(piece.start, out, self.fd)
            else:
                out.copy_(t.reshape(-1)[piece.start:piece.start + out.numel()])
            return piece
        local = piece.to_local().detach()
        for chunk in piece.__create_chunk_list__():  # one box: this rank's shard
            if local.numel():
                self.copy_box(t, tuple(chunk.offsets), tuple(chunk.sizes), local)
        return piece

    def copy_box(self, t: Any, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 out: torch.Tensor) -> None:
        """``out`` (of ``sizes``) := the box of ``t`` at ``offsets``."""
        if isinstance(t, Lazy):
            t.fill_box(offsets, sizes, out, self.fd)
            return
        box = t
        for dim, (at, n) in enumerate(zip(offsets, sizes, strict=True)):
            box = box.narrow(dim, at, n)
        out.copy_(box)
