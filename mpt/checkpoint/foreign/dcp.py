"""A torch.distributed.checkpoint directory written by a plain FSDP2 or DDP script.

The script saved ``{"model": ..., "optimizer": ...}`` as ``get_state_dict`` returns them (full
parameter names, the optimizer keyed by those names: mpt's own by-name form), and maybe
``lr_scheduler`` and ``train_state`` (``step``, ``epoch``). DCP reads it at this one process,
whatever world size wrote it: every tensor is stored with its full shape.

DCP's file-system format keeps every saved chunk of a tensor (a box of it, one per rank that
held a piece) and every non-tensor value as a ``torch.save`` blob at a byte range of a
``.distcp`` file (the metadata's ``_StorageInfo``). ``read`` reads the metadata and the small
values (non-tensor ones, 0-dimensional tensors such as Adam's step); every other tensor is an
``InChunks``: where its chunks lie, read only when a box of it is asked for, and then only the
chunks that overlap the box (``restore``: each rank its own pieces; ``imported.write``: one
whole tensor at a time). A directory whose blobs DCP transformed on writing (an extension,
e.g. compression) is read whole by DCP's own reader instead.

DCP's default storage pickles: its ``.metadata`` file is a pickle, and non-tensor values are
``torch.save`` bytes that DCP's planner reads with ``weights_only=False``. Here the metadata is
unpickled with only DCP's own metadata classes allowed, and every blob with
``weights_only=True``: nothing the files pickled runs.
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from mpt.checkpoint.foreign import optimizer as optim
from mpt.checkpoint.foreign.imported import Imported, Lazy, Opened, Range, as_int, read_into
from mpt.checkpoint.foreign.torchload import first_line
from mpt.errors import UsageError

METADATA = ".metadata"
_METADATA_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
     ("torch.serialization", "_get_layout"), ("torch", "Size"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")})
"""What DCP's metadata pickle may name: its dataclasses, sizes, dtypes and layouts."""


def is_dcp(src: Path) -> bool:
    """Whether ``src`` is a directory DCP's file-system writer made."""
    return (src / METADATA).is_file() and any(src.glob("*.distcp"))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and refuses any global but its own classes and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")


_UNPICKLING_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                      ImportError, IndexError, KeyError)
"""What unpickling a bad, truncated or unsafe file raises (the pickle module's documented
list, and a refused class)."""


class _SafeReader(FileSystemReader):
    """DCP's file-system reader whose metadata read runs no pickled code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / METADATA
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except _UNPICKLING_ERRORS as exc:
            raise UsageError("SRC", path, f"its DCP metadata cannot be read safely: "
                             f"{first_line(exc)}", "pass the directory dcp.save wrote") from None
        if not isinstance(metadata, Metadata):
            raise UsageError("SRC", path, "it holds no DCP metadata",
                             "pass the directory dcp.save wrote")
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


@dataclass(frozen=True)
class Chunk:
    """One saved chunk of a tensor: the box at ``offsets`` of ``sizes``, stored as a
    ``torch.save`` blob of ``length`` bytes at ``offset`` in the file ``path``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: str
    offset: int
    length: int


class InChunks(Lazy):
    """A tensor of a DCP directory, left in its files: its chunks (together, the whole
    tensor, each element in one chunk), each read only when a box that overlaps it is asked
    for."""

    chunks: tuple[Chunk, ...]

    @staticmethod
    def of(size: torch.Size, dtype: torch.dtype, chunks: Sequence[Chunk]) -> InChunks:
        tensor = cast(InChunks, torch.Tensor._make_subclass(
            InChunks, torch.empty(size, dtype=dtype, device="meta")))
        tensor.chunks = tuple(chunks)
        return tensor

    def extents(self) -> tuple[Range, ...]:
        return tuple((c.path, c.offset, c.length) for c in self.chunks)

    def fill_box(self, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor,
                 fd: Callable[[str], int]) -> None:
        for chunk in self.chunks:
            low = [max(a, b) for a, b in zip(offsets, chunk.offsets, strict=True)]
            high = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, chunk.offsets,
                                                            chunk.sizes, strict=True)]
            if any(lo >= hi for lo, hi in zip(low, high, strict=True)):
                continue  # no element of the box in this chunk
            value = _blob(fd(chunk.path), chunk.path, chunk.offset, chunk.length)
            if (not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes
                    or value.dtype != self.dtype):
                raise UsageError("SRC", chunk.path, f"its bytes {chunk.offset} to "
                                 f"{chunk.offset + chunk.length} hold no {self.dtype} chunk of "
                                 f"{chunk.sizes}, which its metadata says they do",
                                 "pass a complete directory dcp.save wrote")
            into = out
            for dim, (lo, hi) in enumerate(zip(low, high, strict=True)):
                value = value.narrow(dim, lo - chunk.offsets[dim], hi - lo)
                into = into.narrow(dim, lo - offsets[dim], hi - lo)
            into.copy_(value)


def _blob(fd: int, path: str, offset: int, length: int) -> Any:
    """The value ``torch.save`` wrote at bytes ``offset`` to ``offset + length`` of the file
    ``fd`` (``path``), loaded with ``weights_only=True``."""
    data = bytearray(length)
    read_into(memoryview(data), fd, path, offset)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, *_UNPICKLING_ERRORS) as exc:
        raise UsageError("SRC", path, f"its bytes {offset} to {offset + length} cannot be "
                         f"read safely: {first_line(exc)}", "pass a complete directory "
                         "dcp.save wrote") from None


def read(src: Path, *, optimizer: bool = True) -> Imported:
    """The training state in DCP directory ``src`` (its optimizer's where ``optimizer``): the
    small values read, the other tensors ``InChunks``."""
    reader = _SafeReader(str(src))
    metadata = reader.read_metadata()
    storage = metadata.storage_data
    if not isinstance(storage, dict) or any(
            getattr(info, "transform_descriptors", None) for info in storage.values()):
        return _read_whole(src, reader, metadata, optimizer=optimizer)
    where: dict[tuple[str, tuple[int, ...] | None], Any] = {
        (index.fqn, None if index.offset is None else tuple(index.offset)): info
        for index, info in storage.items() if isinstance(index, MetadataIndex)}

    def blob_of(key: str, offsets: tuple[int, ...] | None) -> tuple[str, int, int]:
        """The file, offset and length of ``key``'s blob (its chunk at ``offsets``)."""
        info = where.get((key, offsets))
        if info is None:
            raise UsageError("SRC", src, f"its metadata says where no part of {key} lies",
                             "pass a complete directory dcp.save wrote")
        path = (src / info.relative_path).resolve()
        if not path.is_relative_to(src.resolve()):
            raise UsageError("SRC", src, f"its metadata puts {key} in {info.relative_path}, "
                             "outside it", "pass the directory dcp.save wrote")
        return str(path), info.offset, info.length

    flat: dict[str, Any] = {}
    with Opened() as files:
        for key, meta in metadata.state_dict_metadata.items():
            if not optimizer and key.startswith("optimizer."):
                continue
            if isinstance(meta, BytesStorageMetadata):
                path, offset, length = blob_of(key, None)
                flat[key] = _blob(files.fd(path), path, offset, length)
            elif isinstance(meta, TensorStorageMetadata):
                flat[key] = _tensor(src, key, meta, blob_of, files.fd)
    return _imported(src, _nest(flat, metadata.planner_data or {}))


def _tensor(src: Path, key: str, meta: TensorStorageMetadata,
            blob_of: Callable[[str, tuple[int, ...]], tuple[str, int, int]],
            fd: Callable[[str], int]) -> Any:
    """Tensor ``key``: an ``InChunks``, or, 0-dimensional, read."""
    chunks = []
    for chunk in meta.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(meta.size) or any(
                a < 0 or n < 0 or a + n > whole
                for a, n, whole in zip(offsets, sizes, meta.size, strict=True)):
            raise UsageError("SRC", src, f"its metadata puts a chunk of {key} "
                             f"{tuple(meta.size)} at {offsets} of {sizes}, outside it",
                             "pass a complete directory dcp.save wrote")
        chunks.append(Chunk(offsets, sizes, *blob_of(key, offsets)))
    held = sum(math.prod(c.sizes) for c in chunks)
    if held != math.prod(meta.size):
        raise UsageError("SRC", src, f"its chunks of {key} hold {held} elements, not its "
                         f"{math.prod(meta.size)}", "pass a complete directory dcp.save wrote")
    tensor = InChunks.of(meta.size, meta.properties.dtype, chunks)
    return tensor.whole(fd) if tensor.dim() == 0 else tensor


def _read_whole(src: Path, reader: _SafeReader, metadata: Metadata, *,
                optimizer: bool) -> Imported:
    """``read`` by DCP's own reader, every tensor whole (blobs DCP transformed on writing)."""
    flat: dict[str, Any] = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata) else None
        for key, meta in metadata.state_dict_metadata.items()
        if optimizer or not key.startswith("optimizer.")}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(flat, storage_reader=reader, planner=_SafePlanner(
                flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    except (CheckpointException, RuntimeError, ValueError, OSError, *_UNPICKLING_ERRORS) as exc:
        # DCP wraps its ranks' errors; a file may be truncated or unsafe
        raise UsageError("SRC", src, f"reading it with torch.distributed.checkpoint failed: "
                         f"{first_line(exc)}", "pass a complete directory dcp.save wrote"
                         ) from None
    return _imported(src, _nest(flat, metadata.planner_data or {}))


def _nest(flat: dict[str, Any], paths: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict as it was before DCP flattened it (``planner_data``: each key's path)."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        path = list(paths.get(key, (key,)))
        node: Any = nested
        for part, after in itertools.pairwise(path):
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = [] if isinstance(after, int) else {}
                node = node[part]
            else:
                node = node.setdefault(part, [] if isinstance(after, int) else {})
        if isinstance(node, list):
            while len(node) <= path[-1]:
                node.append(None)
        node[path[-1]] = value
    return nested


def _imported(src: Path, nested: dict[str, Any]) -> Imported:
    model = nested.get("model")
    if not isinstance(model, dict) or not model:
        raise UsageError("SRC", src, f"it holds no 'model' state dict (its entries: "
                         f"{', '.join(sorted(nested)[:6])})", "save {'model': ..., "
                         "'optimizer': ...} as get_state_dict returns them")
    weights = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
    named, kind = None, None
    if isinstance(nested.get("optimizer"), dict):
        named, kind = optim.as_torch(nested["optimizer"], str(src))
        optim.check_shapes(named, {k: t.shape for k, t in weights.items()}, str(src))
    train = nested.get("train_state") if isinstance(nested.get("train_state"), dict) else {}
    return Imported(source="torch.distributed.checkpoint", weights=weights, optimizer=named,
                    optimizer_kind=kind, scheduler=nested.get("lr_scheduler"),
                    step=as_int(train.get("step")), epoch=as_int(train.get("epoch")),
                    world_size=_writers(src))


def _writers(src: Path) -> int:
    """How many ranks wrote the directory: DCP names each rank's file ``__<rank>_<n>.distcp``."""
    return len({p.name.split("_")[2] for p in src.glob("__*_*.distcp")}) or 1
