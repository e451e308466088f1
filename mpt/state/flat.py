"""A rank's piece of a tensor that it holds as a range of the tensor's flattened elements.

ZeRO-3 keeps each parameter, its fp32 master and each optimizer state tensor that way: rank r
holds elements ``[r * p, (r + 1) * p)`` of the flattened tensor. A checkpoint stores tensors in
their own shapes, cut into boxes (``ChunkStorageMetadata``), and DCP's safetensors storage keeps
one box per tensor and rank. So a flat range is written as whole rows: each rank writes the rows
that start in its range, the last of which it completes with the few elements the next ranks
hold (``exchange_tails``, one small collective); and it reads the rows its range touches, one
read at a time, keeping only its own elements (``commit``). Nothing on a rank ever holds more
than its own range and one row per tensor besides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist

from mpt.errors import CheckpointError


@dataclass(kw_only=True, slots=True, eq=False)
class FlatPiece:
    """Elements ``start`` to ``start + flat.numel()`` of a tensor of ``shape``, flattened."""

    shape: torch.Size
    """The whole tensor's shape."""
    flat: torch.Tensor
    """This rank's elements (1-D, padding excluded); a load writes into it in place."""
    start: int
    """Where ``flat`` starts in the flattened tensor."""
    tail: torch.Tensor | None = None
    """The elements after ``flat`` to the end of the row it ends in, which the next ranks hold;
    set by ``exchange_tails`` before a save."""

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    def numel(self) -> int:
        """The whole tensor's elements (as ``Tensor.numel``, for sizing checkpoint files)."""
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.flat.element_size()

    @property
    def end(self) -> int:
        return self.start + self.flat.numel()

    @property
    def _dim(self) -> int | None:
        """The dimension cut into rows: the first longer than 1, so that leading ones (a
        ``(1, seq, dim)`` embedding) do not make the whole tensor a single row."""
        return next((d for d, n in enumerate(self.shape) if n > 1), None)

    @property
    def _row(self) -> int:
        """Elements per row."""
        dim = self._dim
        return 1 if dim is None else self.numel() // self.shape[dim]

    def _box(self, first: int, last: int) -> tuple[torch.Size, torch.Size]:
        """Offsets and sizes of rows ``first`` to ``last`` (exclusive)."""
        dim, offsets, sizes = self._dim, [0] * len(self.shape), list(self.shape)
        if dim is not None:
            offsets[dim], sizes[dim] = first, last - first
        return torch.Size(offsets), torch.Size(sizes)

    # -- writing: the rows that start in this rank's range ------------------------------------
    def written_rows(self) -> tuple[int, int]:
        return -(-self.start // self._row), -(-self.end // self._row)

    def write_box(self) -> tuple[torch.Size, torch.Size] | None:
        """Offsets and sizes of what this rank writes, None where no row starts in its range."""
        first, last = self.written_rows()
        return self._box(first, last) if first < last else None

    def write_data(self) -> torch.Tensor:
        """The rows of ``write_box``, contiguous (a copy where a tail completes the last)."""
        first, last = self.written_rows()
        own = self.flat[first * self._row - self.start:]
        if self.tail is None or not self.tail.numel():
            rows = own
        else:
            rows = torch.cat([own, self.tail.to(own.device)])
        return rows.view(self._box(first, last)[1])

    # -- reading: the rows this rank's range touches -------------------------------------------
    def read_box(self) -> tuple[torch.Size, torch.Size] | None:
        """Offsets and sizes of the rows holding this rank's elements, None where it has none."""
        if not self.flat.numel():
            return None
        return self._box(self.start // self._row, -(-self.end // self._row))

    def commit(self, offsets: torch.Size, lengths: torch.Size, data: torch.Tensor) -> None:
        """Keep this rank's elements of ``data``, the part of ``read_box`` at ``offsets`` (from
        the box's corner) of ``lengths``."""
        dim, row = self._dim, self._row
        if dim is not None and list(lengths[dim + 1:]) != list(self.shape[dim + 1:]):
            raise CheckpointError(f"{tuple(self.shape)} tensor", "it was stored cut across "
                                  "its rows, which a flat range cannot be read from",
                                  "load it under a backend that holds whole tensors")
        first = self.start // row + (0 if dim is None else offsets[dim])
        begin = max(first * row, self.start)
        end = min((first + (1 if dim is None else lengths[dim])) * row, self.end)
        if begin < end:
            self.flat[begin - self.start:end - self.start].copy_(
                data.reshape(-1)[begin - first * row:end - first * row])


def exchange_tails(pieces: list[FlatPiece], device: torch.device) -> None:
    """Collective: set each piece's ``tail`` from the ranks after this one.

    The ranks' ranges of a tensor must follow one another in rank order (as ZeRO's partitions
    do). Each rank sends its *head*, the elements before its first row boundary: a rank's tail
    is the heads of the ranks after it, in order. One gather per dtype, of at most a row per
    tensor from every rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    heads = [min(p.flat.numel(), -p.start % p._row) for p in pieces]
    counts = torch.tensor(heads, dtype=torch.int64, device=device)
    every = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(every, counts)
    lengths = torch.stack(every).cpu()  # [rank, piece]
    for dtype in {p.dtype for p in pieces}:
        chosen = [i for i, p in enumerate(pieces) if p.dtype == dtype]
        slots = [max(pieces[i]._row - 1, 0) for i in chosen]
        starts = list(accumulate(slots, initial=0))  # where each piece's slot begins
        mine = torch.zeros(starts[-1], dtype=dtype, device=device)
        for i, at in zip(chosen, starts, strict=False):
            mine[at:at + heads[i]].copy_(pieces[i].flat[:heads[i]])
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        for i, at in zip(chosen, starts, strict=False):
            piece = pieces[i]
            first, last = piece.written_rows()
            need = last * piece._row - piece.end if first < last else 0
            parts = []
            for other in range(rank + 1, world):
                if need <= 0:
                    break
                take = min(int(lengths[other, i]), need)
                parts.append(gathered[other][at:at + take])
                need -= take
            if need:
                raise CheckpointError(f"{tuple(piece.shape)} tensor", "the ranks' ranges of it "
                                      "do not follow one another", "save it unsharded")
            piece.tail = torch.cat(parts) if parts else None

