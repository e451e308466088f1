"""Model and optimizer tensors through ``torch.distributed.checkpoint`` (the sharded variant).

Every rank takes part: DCP plans the save collectively and spreads the tensors over the ranks,
each writing its own safetensors shard (``sharded/shard-0000r-...safetensors``), so no rank
holds or writes everything. Tensors keep their full, unsharded names and shapes, so a load at
any world size reads the pieces it needs: that is the resharding. The storage is DCP's
safetensors writer/reader, chosen because it is the one DCP storage that pickles nothing (the
default writes a pickled ``.metadata``).

A rank reads what it names: its pieces in place, and whole only the keys it is told to (a
pipeline stage's rank reads its own stage's state, never the other stages'); a key it does not
read comes back as an ``Unread``, which refuses every use.

Tensors a rank holds as a flat range of elements (``mpt.state.flat.FlatPiece``, ZeRO-3's
partitions) take part through two planners: they are written as the whole rows that start in
the rank's range and read, one read at a time, into the range in place.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Collection, Mapping
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mpt.checkpoint.format import CheckpointError
from mpt.state.flat import FlatPiece

Tensors = dict[str, torch.Tensor | FlatPiece]

FILE_BYTES = 256 * 2**20
"""Tensors go into files of about this many bytes (whole tensors; a rank's file of a DTensor
holds its piece). safetensors builds each file in memory before writing it, and mpt hashes each
whole, so the largest file, not a rank's share, is what a save or a load adds to its memory."""


def file_numbers(sizes: Mapping[str, int]) -> dict[str, int]:
    """Each key's file (from 1), by the bytes of its tensor: consecutive tensors fill a file up
    to ``FILE_BYTES``, a larger tensor gets one of its own."""
    numbers, number, filled = {}, 1, 0
    for key, size in sizes.items():
        if filled and filled + size > FILE_BYTES:
            number, filled = number + 1, 0
        numbers[key] = number
        filled += size
    return numbers


def _sizes(tensors: Tensors) -> dict[str, int]:
    """Collective where a process group runs: the bytes of every rank's tensors by key (a
    ``DTensor`` counted whole), in rank order. DCP's coordinator files every rank's tensors by
    its own map, which must know the keys of every rank: ranks that hold other tensors (the
    stages of a pipeline) hold other keys."""
    own = {key: t.numel() * t.element_size() for key, t in tensors.items()}
    if not dist.is_initialized():
        return own
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, own)
    return {key: size for sizes in every for key, size in sizes.items()}


def save(tensors: Tensors, directory: str) -> None:
    """Collective: write ``tensors`` (whole and identical on every rank that holds them, or each
    rank's ``DTensor`` shards or ``FlatPiece`` ranges, which it writes itself) as per-rank
    files. Ranks may hold different keys: each key is written by the ranks holding it."""
    writer = HuggingFaceStorageWriter(directory, fqn_to_index_mapping=file_numbers(
        _sizes(tensors)), save_distributed=dist.is_initialized())
    pieces = {key: t for key, t in tensors.items() if isinstance(t, FlatPiece)}
    whole = {key: t for key, t in tensors.items() if key not in pieces}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(whole, storage_writer=writer, planner=_SavePieces(pieces),
                 no_dist=not dist.is_initialized())


class Unread:
    """A tensor of a sharded checkpoint that this rank did not read: state of parameters it does
    not hold (another pipeline stage's), which the ranks holding them read. It stands in its
    place in what ``load`` returns, so that the checkpoint's structure still decodes; the
    pipeline's load keeps its own stage's names and drops it, and any other use raises."""

    __slots__ = ("directory", "key")

    def __init__(self, key: str, directory: str) -> None:
        self.key = key
        self.directory = directory

    def __repr__(self) -> str:
        return f"Unread({self.key!r})"

    def refuse(self) -> NoReturn:
        raise CheckpointError(self.directory, f"this rank did not read {self.key}, the state "
                              "of a parameter it does not hold", "load only the state of the "
                              "parameters this rank holds (its backend's local_*_state_dict "
                              "keys), or read the checkpoint whole")

    def __getattr__(self, name: str) -> Any:  # any tensor method or attribute
        if name in Unread.__slots__:  # not set yet (a copy being made)
            raise AttributeError(name)
        self.refuse()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:  # a torch function given it
        unread = next(a for a in [*args, *(kwargs or {}).values()] if isinstance(a, Unread))
        unread.refuse()


def load(directory: str, into: Tensors, *, whole: Collection[str] | None = None
         ) -> dict[str, torch.Tensor | FlatPiece | Unread]:
    """Collective: every tensor the shards in ``directory`` hold, by key.

    A key of ``into`` is read in place into that tensor, a ``DTensor`` or ``FlatPiece`` read
    only where its pieces lie (resharded from any world size); every other key of ``whole``
    (``None``: every other key) is read whole, on the CPU, and the rest is not read at all: an
    ``Unread`` stands for it. Keys of ``into`` or ``whole`` the checkpoint lacks are left alone.
    """
    reader = HuggingFaceStorageReader(directory)
    metadata = reader.read_metadata()
    stored = metadata.state_dict_metadata
    for key, piece in into.items():
        if isinstance(piece, FlatPiece) and key in stored and stored[key].size != piece.shape:
            raise CheckpointError(directory, f"it holds {key} as {tuple(stored[key].size)}, "
                                  f"this run has {tuple(piece.shape)}",
                                  "load it into the model it was saved from")
    wanted = set(stored) if whole is None else {*into, *whole}
    tensors = {key: into[key] if key in into else torch.empty(tuple(meta.size),
                                                              dtype=meta.properties.dtype)
               for key, meta in stored.items() if key in wanted}
    pieces = {key: t for key, t in tensors.items() if isinstance(t, FlatPiece)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({key: t for key, t in tensors.items() if key not in pieces},
                 storage_reader=reader, planner=_LoadPieces(pieces),
                 no_dist=not dist.is_initialized())
    return {key: tensors[key] if key in tensors else Unread(key, directory) for key in stored}


class _SavePieces(DefaultSavePlanner):
    """DCP's planner, plus one write of whole rows per ``FlatPiece`` that has any."""

    def __init__(self, pieces: dict[str, FlatPiece]) -> None:
        super().__init__()
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for key, piece in self.pieces.items():
            box = piece.write_box()
            if box is not None:
                items.append(WriteItem(
                    index=MetadataIndex(key, box[0]), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=box[0], sizes=box[1]),
                        properties=TensorProperties(dtype=piece.dtype), size=piece.shape)))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        piece = self.pieces.get(write_item.index.fqn)
        return super().resolve_data(write_item) if piece is None else piece.write_data()


class _LoadPieces(DefaultLoadPlanner):
    """DCP's planner, plus reads of the rows each ``FlatPiece`` touches, each into a buffer of
    its own that ``FlatPiece.commit`` takes this rank's elements from."""

    def __init__(self, pieces: dict[str, FlatPiece]) -> None:
        super().__init__()
        self.pieces = pieces

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items: list[ReadItem] = []
        for key, piece in self.pieces.items():
            box = piece.read_box()
            stored = self.metadata.state_dict_metadata[key] if self.metadata else None
            if box is not None and isinstance(stored, TensorStorageMetadata):
                items += create_read_items_for_chunk_list(
                    key, stored, [ChunkStorageMetadata(offsets=box[0], sizes=box[1])])
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = self.pieces.get(read_item.dest_index.fqn)
        if piece is None:
            return super().resolve_tensor(read_item)
        return torch.empty(read_item.lengths, dtype=piece.dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        piece = self.pieces.get(read_item.dest_index.fqn)
        if piece is not None:
            piece.commit(read_item.dest_offsets, read_item.lengths, tensor)
