"""Hugging Face safetensors weights: a model's initial weights, with no training state.

``save_pretrained`` writes a model's weights as ``model.safetensors`` or, past its shard size,
as ``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``); ``safetensors.torch.
save_file`` writes one such file by itself. They hold weights by the model's own names and
nothing else: the optimizer, the LR schedule and the step start afresh (at 0).

Files are read with the safetensors library (a JSON header and raw tensor bytes: nothing is
unpickled), one file at a time, each tensor copied out of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mpt.checkpoint.foreign.imported import NEVER_HELD, Imported
from mpt.checkpoint.foreign.torchload import first_line
from mpt.errors import UsageError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
"""What ``save_pretrained`` writes beside the weights."""
SUFFIX = ".safetensors"
_FIX = "pass a file safetensors.torch.save_file wrote, or a save_pretrained directory"
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.float64: "fp64"}


def is_hf(src: Path) -> bool:
    """Whether ``src`` is a safetensors file, an index of shards, or a directory
    ``save_pretrained`` wrote (its index, or ``model.safetensors`` beside ``config.json``)."""
    if src.is_dir():
        return (src / INDEX).is_file() or ((src / SINGLE).is_file() and
                                           (src / CONFIG).is_file())
    return src.is_file() and (src.suffix == SUFFIX or src.name.endswith(f"{SUFFIX}.index.json"))


def read(src: Path) -> Imported:
    """The weights at ``src`` (a file, an index, or a directory), one file at a time."""
    files = _files(src)
    weights: dict[str, torch.Tensor] = {}
    for path, names in files.items():
        weights.update(_read_file(path, names))
    if not weights:
        raise UsageError("SRC", src, "it holds no tensors", _FIX)
    dtypes = sorted({_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))
                     for t in weights.values() if t.is_floating_point()})
    count = f"{len(files)} file{'s' if len(files) > 1 else ''}"
    return Imported(source=f"Hugging Face safetensors, {count}", weights=weights,
                    precision=", ".join(dtypes) or "fp32", step=0,
                    lacks=["the optimizer's state", "the LR scheduler",
                           "the step (it starts at 0)", *NEVER_HELD])


def _files(src: Path) -> dict[Path, list[str] | None]:
    """Each file to read, with the names the index maps to it (None: all it holds)."""
    if src.is_file() and src.suffix == SUFFIX:
        return {src: None}
    index = src / INDEX if src.is_dir() else src
    if not index.is_file():  # a directory of model.safetensors and config.json
        return {src / SINGLE: None}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise TypeError("weight_map is not a mapping of names to files")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError("SRC", index, f"it is no safetensors index ({first_line(exc)}): "
                         "save_pretrained writes {\"metadata\": {...}, \"weight_map\": "
                         "{name: file}}", _FIX) from None
    files: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        path = index.parent / file
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise UsageError("SRC", index, f"its weight_map sends {name} to {file}, outside "
                             "its directory", _FIX)
        files.setdefault(path, []).append(name)
    missing = sorted(p.name for p in files if not p.is_file())
    if missing:
        raise UsageError("SRC", index, f"its shard {', '.join(missing[:3])} is missing "
                         f"({len(missing)} of {len(files)})", "copy every file the index names")
    return {path: names for path, names in sorted(files.items())}


def _read_file(path: Path, names: list[str] | None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (all where None) of the safetensors file ``path``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            held = set(f.keys())
            wanted = sorted(held) if names is None else names
            absent = [name for name in wanted if name not in held]
            if absent:
                raise UsageError("SRC", path, f"it lacks {', '.join(absent[:3])}, which the "
                                 "index maps to it", "copy the shards the index was written "
                                 "with")
            return {name: f.get_tensor(name) for name in wanted}
    except (SafetensorError, OSError) as exc:
        raise UsageError("SRC", path, f"safetensors refused it: {first_line(exc)}",
                         _FIX) from None
