"""Model and optimizer tensors through ``torch.distributed.checkpoint`` (the sharded variant).

Every rank takes part: DCP plans the save collectively and spreads the tensors over the ranks,
each writing its own safetensors shard (``sharded/shard-0000r-...safetensors``), so no rank
holds or writes everything. Tensors keep their full, unsharded names and shapes, so a load at
any world size reads the pieces it needs: that is the resharding. The storage is DCP's
safetensors writer/reader, chosen because it is the one DCP storage that pickles nothing (the
default writes a pickled ``.metadata``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)

FILE_BYTES = 256 * 2**20
"""Tensors go into files of about this many bytes (whole tensors; a rank's file of a DTensor
holds its piece). safetensors builds each file in memory before writing it, and mpt hashes each
whole, so the largest file, not a rank's share, is what a save or a load adds to its memory."""


def file_numbers(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each key's file (from 1): consecutive tensors fill a file up to ``FILE_BYTES`` (counting
    a DTensor whole, the same on every rank), a larger tensor gets one of its own."""
    numbers, number, filled = {}, 1, 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if filled and filled + size > FILE_BYTES:
            number, filled = number + 1, 0
        numbers[key] = number
        filled += size
    return numbers


def save(tensors: dict[str, torch.Tensor], directory: str) -> None:
    """Collective: write ``tensors`` (whole and identical on every rank, or each rank's
    ``DTensor`` shards, which it writes itself) as per-rank shard files."""
    writer = HuggingFaceStorageWriter(directory, fqn_to_index_mapping=file_numbers(tensors),
                                      save_distributed=dist.is_initialized())
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())


def load(directory: str, into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collective: every tensor the shards in ``directory`` hold, by key.

    A key of ``into`` is read in place into that tensor, a ``DTensor`` read only where its
    shards lie (resharded from any world size); every other tensor is read whole, on the CPU.
    """
    reader = HuggingFaceStorageReader(directory)
    metadata = reader.read_metadata()
    tensors = {key: into[key] if key in into else torch.empty(tuple(meta.size),
                                                              dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(tensors, storage_reader=reader, no_dist=not dist.is_initialized())
    return tensors
