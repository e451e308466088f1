"""A torch.distributed.checkpoint directory written by a plain FSDP2 or DDP script.

The script saved ``{"model": ..., "optimizer": ...}`` as ``get_state_dict`` returns them (full
parameter names, the optimizer keyed by those names: mpt's own by-name form), and maybe
``lr_scheduler`` and ``train_state`` (``step``, ``epoch``). DCP reads it at this one process,
whatever world size wrote it: every tensor is stored with its full shape.

DCP's default storage pickles: its ``.metadata`` file is a pickle, and non-tensor values are
``torch.save`` bytes that DCP's planner reads with ``weights_only=False``. Here the metadata is
unpickled with only DCP's own metadata classes allowed, and the values with
``weights_only=True``: nothing the files pickled runs.
"""

from __future__ import annotations

import io
import itertools
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from mpt.checkpoint.foreign import optimizer as optim
from mpt.checkpoint.foreign.imported import Imported, as_int
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


def read(src: Path, *, optimizer: bool = True) -> Imported:
    """The training state in DCP directory ``src`` (its optimizer's where ``optimizer``)."""
    reader = _SafeReader(str(src))
    metadata = reader.read_metadata()
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
    nested = _nest(flat, metadata.planner_data or {})
    return _imported(src, nested)


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
