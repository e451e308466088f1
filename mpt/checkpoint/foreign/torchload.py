"""``torch.load`` of another framework's file without running anything it pickled.

Every read is ``weights_only=True``: torch's own unpickler, which builds tensors, containers and
numbers and refuses every other global. DeepSpeed's files name three of its own classes; they are
let in by name only, each mapped to a stand-in defined here that keeps the pickled attributes as
plain data (so neither DeepSpeed's code runs nor DeepSpeed has to be installed to convert).

``load(..., lazily=True)`` reads the pickled structure alone: every tensor comes back on the
meta device (shape, dtype, no data) with where its bytes lie in the file (``where``), for a
reader that copies large tensors piece by piece with plain file reads (``read``) instead of
holding them, or a mapping of them, in memory.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from mpt.errors import UsageError


class LossScalerState:
    """Stands in for DeepSpeed's ``LossScaler``/``DynamicLossScaler``: their attributes
    (``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_window``, ``dynamic``, ...)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Plain values only (numbers, bools, a dtype): the unpickler built nothing else.
        self.__dict__.update(state)


class FragmentAddress:
    """Stands in for DeepSpeed's ``fragment_address``: where one parameter's piece lies in a
    rank's flat partition."""

    numel: int
    start: int

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.numel, self.start = int(state["numel"]), int(state["start"])


_DEEPSPEED_NAMES: list[Any] = [
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    # an IntEnum, pickled as ZeroStageEnum(2): the stage number is all it holds
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def load(path: str | os.PathLike[str], *, deepspeed: bool = False, lazily: bool = False
         ) -> Any:
    """The object the torch file at ``path`` holds, on the CPU, read with ``weights_only=True``
    (and DeepSpeed's three data classes where ``deepspeed``); one UsageError naming the file
    and torch's reason where it is unreadable or would run code.

    Tensors of a zip-format file are memory-mapped, not read: a conversion then touches only
    the bytes it copies, and the page cache, not the process, holds the rest. ``lazily``: every
    tensor on the meta device instead, its bytes left in the file (``where``, ``read``); the
    pages a mapping's reader touched would count in its memory as long as the mapping lived."""
    allowed = _DEEPSPEED_NAMES if deepspeed else []
    zipped = is_torch_file(Path(path))
    if lazily and not zipped:
        raise UsageError("SRC", path, "it is in torch's legacy (non-zip) format, whose tensors "
                         "cannot be read piece by piece", "load it and torch.save it again")
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="meta" if lazily else "cpu",
                              weights_only=True, mmap=zipped and not lazily)
    except FileNotFoundError:
        raise UsageError("SRC", path, "the file is missing", "pass a complete checkpoint"
                         ) from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        # what torch raises for an unsafe pickle, a truncated zip, or a file of another kind
        raise UsageError("SRC", path, f"torch.load(weights_only=True) refused it: "
                         f"{first_line(exc)}", "pass the file as the framework wrote it (a "
                         "pickle that runs code is never loaded)") from None


def where(path: str | os.PathLike[str], tensor: torch.Tensor) -> tuple[int, int]:
    """The byte offset in ``path`` and the byte count of a tensor that ``load(path,
    lazily=True)`` returned (torch records each storage's offset in the zip as it reads the
    structure onto the meta device)."""
    offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
    if offset is None or not tensor.is_contiguous():
        raise UsageError("SRC", path, f"a tensor of shape {tuple(tensor.shape)} in it is not "
                         "stored contiguously, as one range of bytes", "load it and torch.save "
                         "it again")
    size = tensor.element_size()
    return offset + tensor.storage_offset() * size, tensor.numel() * size


def read(path: str | os.PathLike[str], tensor: torch.Tensor) -> torch.Tensor:
    """The values of ``tensor``, one that ``load(path, lazily=True)`` returned, read from
    ``path`` with a plain file read (for small tensors: a step count, a scale)."""
    offset, size = where(path, tensor)
    with open(path, "rb") as f:
        data = bytearray(os.pread(f.fileno(), size, offset))
    if len(data) != size:
        raise UsageError("SRC", path, f"it ends before its tensor at byte {offset} + {size}",
                         "pass the file as the framework wrote it, complete")
    flat = torch.frombuffer(data, dtype=tensor.dtype) if size else torch.empty(
        0, dtype=tensor.dtype)
    return flat.view(tensor.shape)


def values(path: str | os.PathLike[str], obj: Any) -> Any:
    """``obj``, a part of what ``load(path, lazily=True)`` returned, with its tensors read
    (small ones only: a step count, a loss scale, a param group's hyper-parameters)."""
    if isinstance(obj, torch.Tensor):
        return read(path, obj)
    if isinstance(obj, dict):
        return {key: values(path, value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(values(path, value) for value in obj)
    if isinstance(obj, LossScalerState):
        obj.__dict__.update(values(path, vars(obj)))
    return obj


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type where it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_torch_file(path: Path) -> bool:
    """Whether ``path`` is a file in torch.save's zip format (its first bytes say so)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False
