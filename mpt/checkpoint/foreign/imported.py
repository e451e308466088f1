"""A training state read from another framework's checkpoint, and its writing in mpt's format.

Every reader (DeepSpeed, torch.distributed.checkpoint, a torch.save file) returns one
``Imported``: the weights by name, the optimizer state in the by-name form mpt's own
checkpoints hold (``mpt.state.named``), the LR scheduler's state, the loss scale, the step and
epoch, and what the format does not hold. ``write`` commits it as an mpt checkpoint that
``rt.load``/``--resume`` restore under any backend and world size.

A reader may leave large tensors in the source's files (``OnDisk``: where their bytes lie):
``write`` streams each safetensors file, header first, then every tensor's bytes in key order,
through a few reused buffers that a source's ranges are read into, so that what a conversion
holds does not grow with the model (ZeRO's files, ``zero``).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import math
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
from mpt.errors import UsageError
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
_BLOCK = 4 << 20
"""Bytes per buffer a file is made in: filled, written and hashed whole."""
_BUFFERS = 4
"""Buffers per file: one being filled, one hashed, one written and one to spare; all that a
file's writing holds, whatever the model's size."""
_ALIGN = 4096
"""What ``O_DIRECT`` needs a write's length, offset and memory to be a multiple of (a block
of any disk's; the buffers are page-aligned mappings, every block but the last is whole)."""
_DROP = 64 << 20
"""Bytes written through the page cache (where ``O_DIRECT`` is refused) between two
``POSIX_FADV_DONTNEED`` of what the file holds so far: the first starts writing a range back,
a later one drops its pages, once clean, so the next writes reuse them. Taking ever more fresh
pages (4 GiB of them for a 350 M-parameter state) cost most of a conversion's system time in a
virtual machine."""


class Lazy(torch.Tensor):
    """A tensor whose values stay in the source's files until asked for, any box or range of
    it at a time. It is a meta tensor (shape and dtype, no data), so every check of shapes and
    every step that only names tensors (``encode``, a safetensors header) takes it as it is;
    any other use of its values fails, as a meta tensor's does, rather than read them silently.
    A subclass says where its values lie and reads them: ``OnDisk`` (plain byte ranges: ZeRO's
    partitions), ``dcp.InChunks`` (DCP's ``torch.save`` blobs)."""

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

    def fill_range(self, start: int, out: torch.Tensor, fd: Callable[[str], int]) -> None:
        """``out`` (1-D) := its elements from ``start``, flattened (a ZeRO flat piece's): the
        box of whole rows along the first dimension that holds them is read, then cut."""
        if out.numel() == 0:
            return
        if self.dim() == 0:
            out.copy_(self.whole(fd).reshape(-1)[start:start + out.numel()])
            return
        row = math.prod(self.shape[1:])
        first, last = start // row, -(-(start + out.numel()) // row)
        rows = torch.empty((last - first, *self.shape[1:]), dtype=self.dtype)
        self.fill_box((first,) + (0,) * (self.dim() - 1), tuple(rows.shape), rows, fd)
        at = start - first * row
        out.copy_(rows.view(-1)[at:at + out.numel()])

    def whole(self, fd: Callable[[str], int] | None = None) -> torch.Tensor:
        """All of it, in memory (read through ``fd``, or files opened for this read)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        if out.numel() == 0:
            return out
        with Opened() as files:
            self.fill_box((0,) * out.dim(), tuple(out.shape), out, fd or files.fd)
        return out


class OnDisk(Lazy):
    """A tensor whose elements, in order, are the bytes of ``ranges`` (pieces of other files,
    e.g. every ZeRO rank's share of one parameter): read with plain reads of just the bytes
    asked for, straight into the memory they go to; ``write`` copies them file to file."""

    ranges: tuple[Range, ...]

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

    def extents(self) -> tuple[Range, ...]:
        return self.ranges

    def fill_box(self, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor,
                 fd: Callable[[str], int]) -> None:
        into = out if out.dtype == self.dtype and out.is_contiguous() else torch.empty(
            tuple(sizes), dtype=self.dtype)
        flat, done = into.view(-1), 0
        for start, count in _runs(tuple(self.shape), tuple(offsets), tuple(sizes)):
            self.fill_range(start, flat[done:done + count], fd)
            done += count
        if into is not out:
            out.copy_(into)

    def fill_range(self, start: int, out: torch.Tensor, fd: Callable[[str], int]) -> None:
        if out.dtype != self.dtype or not out.is_contiguous():
            buffer = torch.empty(out.numel(), dtype=self.dtype)
            self.fill_range(start, buffer, fd)
            out.copy_(buffer)
            return
        size = self.dtype.itemsize
        low, high = start * size, (start + out.numel()) * size
        if low == high:
            return
        view = memoryview(out.detach().view(torch.uint8).numpy())
        at = 0  # where each range starts in the tensor's bytes
        for path, offset, count in self.ranges:
            first, last = max(low, at), min(high, at + count)
            if first < last:
                read_into(view[first - low:last - low], fd(path), path, offset + first - at)
            at += count


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
    an ``OnDisk`` tensor's bytes copied from its files; return the size and sha256.

    The file is made in ``_BUFFERS`` reused buffers of ``_BLOCK`` bytes, each passed along
    three threads: this one fills it (``preadv`` from the sources' page cache, or a copy of
    memory), a second hashes it, a third writes it and gives it back to be filled again, so
    that reading, hashing and the disk's writing overlap. A local file is written with
    ``O_DIRECT`` (``_Output``): no copy into the page cache, no page-cache pages to take,
    write back and drop, which were most of a conversion's system time."""
    ordered = {name: t if isinstance(t, Lazy) else t.detach().to("cpu").contiguous()
               for name, t in sorted(tensors.items())}
    sha = hashlib.sha256()
    free: Queue[memoryview] = Queue()
    filled: Queue[memoryview | None] = Queue()
    hashed: Queue[memoryview | None] = Queue()
    failed: list[BaseException] = []

    def hash_all() -> None:
        while (block := filled.get()) is not None:
            sha.update(block)
            hashed.put(block)
        hashed.put(None)

    def write_all(out: _Output) -> None:
        while (block := hashed.get()) is not None:
            if not failed:
                try:
                    out.write(block)
                except BaseException as exc:  # raised in the caller's thread, below
                    failed.append(exc)
            free.put(block)  # given back after a failure too: the filling never waits forever

    for _ in range(_BUFFERS):  # page-aligned, as O_DIRECT needs; unmapped once unreferenced
        free.put(memoryview(mmap.mmap(-1, _BLOCK)))
    size = 0
    with _Output(f) as out, Opened() as files:
        threads = [threading.Thread(target=hash_all),
                   threading.Thread(target=write_all, args=(out,))]
        for thread in threads:
            thread.start()
        try:
            for block in _blocks(_segments(ordered, files), free, files):
                if failed:
                    break
                filled.put(block)
                size += len(block)
        finally:
            filled.put(None)
            for thread in threads:
                thread.join()
    if failed:
        raise failed[0]
    return FileEntry(sha256=sha.hexdigest(), bytes=size)


def _segments(ordered: dict[str, torch.Tensor], files: Opened
              ) -> Iterator[memoryview | Range]:
    """The safetensors file of ``ordered`` (CPU, ``OnDisk`` or ``Lazy`` tensors, in key
    order), as the bytes in memory (the header, a tensor) or the source's ranges it is made of,
    in order. A ``Lazy`` tensor is read whole in its turn and let go at the next one: each
    segment is copied out before the next is asked for."""
    yield memoryview(tensorfile.header(ordered))
    for tensor in ordered.values():
        if isinstance(tensor, OnDisk):
            yield from tensor.ranges
            continue
        whole = tensor.whole(files.fd) if isinstance(tensor, Lazy) else tensor
        yield tensorfile.raw_bytes(whole)  # valid while ``whole`` lives: until the next one


def _blocks(segments: Iterator[memoryview | Range], free: Queue[memoryview], files: Opened
            ) -> Iterator[memoryview]:
    """``segments``' bytes, in buffers taken from ``free`` (waiting for one the writing thread
    has given back), each full but the last."""
    block, at = free.get(), 0
    for segment in segments:
        done, count = 0, len(segment) if isinstance(segment, memoryview) else segment[2]
        while done < count:
            n = min(count - done, len(block) - at)
            if isinstance(segment, memoryview):
                block[at:at + n] = segment[done:done + n]
            else:
                path, offset, _ = segment
                read_into(block[at:at + n], files.fd(path), path, offset + done)
            done, at = done + n, at + n
            if at == len(block):
                yield block
                block, at = free.get(), 0
    if at:
        yield block[:at]


def read_into(view: memoryview, fd: int, path: str, offset: int) -> None:
    """``view`` := the file's bytes from ``offset`` (``preadv``: a copy out of the page cache,
    the GIL released, no mapping to make and unmake)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise UsageError("SRC", path, f"it ends at byte {offset + done}, before a tensor's "
                             f"bytes {offset} to {offset + len(view)}", "pass the checkpoint as "
                             "the framework wrote it, complete")
        done += n


class _Output:
    """Where ``_stream`` writes: a local file by its descriptor, with ``O_DIRECT`` while the
    filesystem takes it and the writes are whole aligned blocks (the last one, and any after a
    refusal, go through the page cache, dropped from it every ``_DROP`` bytes); a remote file
    through ``f.write``."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.fd = _fileno(f)
        self.flags = 0
        self.direct = False
        self.size = self.dropped = 0
        if self.fd is not None:
            f.flush()  # nothing written through ``f`` may follow ours
        if self.fd is not None and hasattr(os, "O_DIRECT"):  # Linux's; elsewhere buffered
            import fcntl

            self.flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, self.flags | os.O_DIRECT)
                self.direct = True
            except OSError:  # a filesystem without O_DIRECT (EINVAL): through the page cache
                pass

    def __enter__(self) -> _Output:
        return self

    def __exit__(self, *exc: object) -> None:
        self.buffered()

    def buffered(self) -> None:
        """Write through the page cache from now on."""
        if self.direct:
            import fcntl

            fcntl.fcntl(self.fd, fcntl.F_SETFL, self.flags)  # type: ignore[arg-type]
            self.direct = False
            self.dropped = self.size  # none of what O_DIRECT wrote is in the page cache

    def write(self, block: memoryview) -> None:
        """Append ``block``."""
        if self.fd is None:
            self.f.write(block)
            return
        if len(block) % _ALIGN:
            self.buffered()
        while block:
            try:
                n = os.write(self.fd, block)
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                self.buffered()  # O_DIRECT refused after all: the same bytes, buffered
                continue
            block, self.size = block[n:], self.size + n
        if (not self.direct and self.size - self.dropped >= _DROP
                and hasattr(os, "posix_fadvise")):  # not on macOS
            os.posix_fadvise(self.fd, 0, self.size, os.POSIX_FADV_DONTNEED)
            self.dropped = self.size


def _fileno(f: BinaryIO) -> int | None:
    """The descriptor of a local file; None for a remote one."""
    try:
        return f.fileno()
    except (OSError, AttributeError, ValueError):  # io.UnsupportedOperation is an OSError
        return None
