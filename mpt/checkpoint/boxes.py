"""The training state as boxes that ranks hold: which rank keeps which, and how a rank of any
later layout fills the parts it holds from them.

Every tensor of the state is held as a box (offsets and sizes within the whole tensor's
shape): a ``DTensor``'s local shard (fsdp, tensor parallelism), the whole rows of a ZeRO-3
range (``FlatPiece``), or the whole tensor (where every rank holds the whole state, or its
stage's). A box several ranks hold alike (replicas: every ddp rank, HSDP's replicate axis) is
kept by one of them, the bytes spread evenly (``assign``), so that under ddp each rank keeps
1/N of the state. ``Table`` lists every kept box and its rank; it is small (one row per tensor
and rank) and tells a restore where each part lies, so that each rank fetches the boxes that
overlap its own parts (``Target``) and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from mpt.precision.base import dtype_name
from mpt.state.flat import FlatPiece


@dataclass(frozen=True, slots=True)
class Box:
    """One rank's part of tensor ``key``: ``sizes`` elements from ``offsets`` in each dim."""

    key: str
    dtype: str
    """The tensor's dtype, as ``str(torch.float32)`` without ``torch.``."""
    shape: tuple[int, ...]
    """The whole tensor's shape."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.torch_dtype.itemsize

    def row(self) -> list[Any]:
        return [self.key, self.dtype, list(self.shape), list(self.offsets), list(self.sizes)]

    @classmethod
    def from_row(cls, row: list[Any]) -> Box:
        key, dtype, shape, offsets, sizes = row
        return cls(key, dtype, tuple(shape), tuple(offsets), tuple(sizes))


def held(key: str, value: torch.Tensor | FlatPiece) -> tuple[Box, torch.Tensor] | None:
    """The box this rank holds of state tensor ``value`` and its data (None: it holds none)."""
    if isinstance(value, FlatPiece):
        box = value.write_box()  # whole rows (the tails exchanged by the backend)
        if box is None:
            return None
        return Box(key, dtype_name(value.dtype), tuple(value.shape), tuple(box[0]),
                   tuple(box[1])), value.write_data()
    if isinstance(value, DTensor):
        local = value.to_local()
        if not local.numel():
            return None
        [chunk] = value.__create_chunk_list__()
        return Box(key, dtype_name(value.dtype), tuple(value.shape), tuple(chunk.offsets),
                   tuple(chunk.sizes)), local
    shape = tuple(value.shape)
    return Box(key, dtype_name(value.dtype), shape, (0,) * len(shape), shape), value


def assign(holders: list[list[Box]]) -> list[list[Box]]:
    """Each distinct box once, on one of the ranks holding it (``holders[rank]``): the one
    with the fewest bytes assigned so far, then the lowest rank. Every rank computes the same
    assignment from the same lists."""
    owners: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    boxes: dict[tuple[str, tuple[int, ...]], Box] = {}
    for rank, mine in enumerate(holders):
        for box in mine:
            owners.setdefault((box.key, box.offsets), []).append(rank)
            boxes[box.key, box.offsets] = box
    load = [0] * len(holders)
    kept: list[list[Box]] = [[] for _ in holders]
    # Largest first: the greedy balance is then within one box of even.
    for where in sorted(boxes, key=lambda w: (-boxes[w].nbytes, w)):
        rank = min(owners[where], key=lambda r: (load[r], r))
        load[rank] += boxes[where].nbytes
        kept[rank].append(boxes[where])
    return kept


@dataclass(kw_only=True, slots=True)
class Target:
    """Where this rank puts state tensor ``key``: into ``tensor`` (its whole box, or a
    ``DTensor``'s local shard in place), or through ``piece.commit`` (a ``FlatPiece``)."""

    box: tuple[tuple[int, ...], tuple[int, ...]]
    """Offsets and sizes of what it needs within the whole tensor."""
    tensor: torch.Tensor | None = None
    piece: FlatPiece | None = None
    held: DTensor | None = None
    """The run's ``DTensor`` whose local shard ``tensor`` is."""

    @classmethod
    def of(cls, value: Any, stored: Box) -> Target:
        """Where ``value`` (what the run holds under this key: a ``DTensor``, a ``FlatPiece``,
        or None to read the whole tensor ``stored`` describes) is filled; a rank that holds
        no part of it (an empty shard) gets an empty box."""
        if isinstance(value, FlatPiece):
            box = value.read_box()
            empty = ((0,) * len(value.shape),) * 2
            return cls(box=empty if box is None else (tuple(box[0]), tuple(box[1])),
                       piece=value)
        if isinstance(value, DTensor):
            [chunk] = value.__create_chunk_list__()
            return cls(box=(tuple(chunk.offsets), tuple(chunk.sizes)), tensor=value.to_local(),
                       held=value)
        return cls(box=((0,) * len(stored.shape), stored.shape),
                   tensor=torch.empty(stored.shape, dtype=stored.torch_dtype))

    def overlap(self, stored: Box) -> list[tuple[int, int]] | None:
        """Per dim, the range of the whole tensor that ``stored`` and this target share."""
        spans = []
        for at, size, have, length in zip(self.box[0], self.box[1], stored.offsets,
                                          stored.sizes, strict=True):
            begin, end = max(at, have), min(at + size, have + length)
            if begin >= end:
                return None
            spans.append((begin, end))
        return spans

    def fill(self, stored: Box, data: torch.Tensor) -> None:
        """Copy the part of ``data`` (the box ``stored``) that this target needs."""
        spans = self.overlap(stored)
        if spans is None:
            return
        source = data
        for dim, (begin, end) in enumerate(spans):
            source = source.narrow(dim, begin - stored.offsets[dim], end - begin)
        if self.piece is not None:
            self.piece.commit(torch.Size(b - o for (b, _), o in zip(spans, self.box[0],
                                                                    strict=True)),
                              torch.Size(e - b for b, e in spans), source)
            return
        assert self.tensor is not None
        destination = self.tensor
        for dim, (begin, end) in enumerate(spans):
            destination = destination.narrow(dim, begin - self.box[0][dim], end - begin)
        destination.copy_(source)

    @property
    def value(self) -> Any:
        """What the restored state holds under this key: the whole tensor, or the run's own
        ``DTensor``/``FlatPiece`` (filled in place)."""
        if self.piece is not None:
            return self.piece
        return self.held if self.held is not None else self.tensor
