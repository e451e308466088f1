"""``torch.load`` of another framework's file without running anything it pickled.

Every read is ``weights_only=True``: torch's own unpickler, which builds tensors, containers and
numbers and refuses every other global. DeepSpeed's files name three of its own classes; they are
let in by name only, each mapped to a stand-in defined here that keeps the pickled attributes as
plain data (so neither DeepSpeed's code runs nor DeepSpeed has to be installed to convert).
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


def load(path: str | os.PathLike[str], *, deepspeed: bool = False) -> Any:
    """The object the torch file at ``path`` holds, on the CPU, read with ``weights_only=True``
    (and DeepSpeed's three data classes where ``deepspeed``); one UsageError naming the file
    and torch's reason where it is unreadable or would run code.

    Tensors of a zip-format file are memory-mapped, not read: a conversion then touches only
    the bytes it copies, and the page cache, not the process, holds the rest."""
    allowed = _DEEPSPEED_NAMES if deepspeed else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True,
                              mmap=is_torch_file(Path(path)))
    except FileNotFoundError:
        raise UsageError("SRC", path, "the file is missing", "pass a complete checkpoint"
                         ) from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        # what torch raises for an unsafe pickle, a truncated zip, or a file of another kind
        raise UsageError("SRC", path, f"torch.load(weights_only=True) refused it: "
                         f"{first_line(exc)}", "pass the file as the framework wrote it (a "
                         "pickle that runs code is never loaded)") from None


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
