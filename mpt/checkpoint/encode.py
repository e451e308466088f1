"""Nested state (dicts, lists, numbers, tensors) as JSON plus a flat dict of tensors, and back.

Optimizer, precision and scheduler states mix hyper-parameters with tensors. Tensors go to
safetensors under a path-like key (``optimizer/fc.weight/exp_avg``); in the JSON the value
becomes ``{"__tensor__": key}``. Tuples and dicts with non-string keys are tagged so that they
come back as they were. Anything else (a function, an arbitrary object) is refused at save time,
because it could only be stored by pickling.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch

from mpt.errors import UsageError
from mpt.state.flat import FlatPiece

_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"


def encode(obj: Any, key: str, tensors: dict[str, Any]) -> Any:
    """JSON-able ``obj``; its tensors (and a rank's ``FlatPiece`` ranges of tensors) are added
    to ``tensors`` under keys starting with ``key``."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach()  # not copied: an asynchronous save copies what it keeps
        return {_TENSOR: key}
    if isinstance(obj, FlatPiece):
        tensors[key] = obj
        return {_TENSOR: key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        if _plain(obj):  # e.g. Python's RNG state, 625 ints: what the loop below would give
            return {_TUPLE: list(obj)}
        return {_TUPLE: [encode(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        if _plain(obj):
            return list(obj)
        return [encode(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not {_TENSOR, _TUPLE, _ITEMS} & set(obj):
            return {k: encode(v, f"{key}/{k}", tensors) for k, v in obj.items()}
        return {_ITEMS: [[encode(k, f"{key}/k{i}", tensors), encode(v, f"{key}/{i}", tensors)]
                         for i, (k, v) in enumerate(obj.items())]}
    raise UsageError(key.split("/")[0], type(obj).__name__,
                     f"{key} holds a {type(obj).__name__}, which a checkpoint cannot store "
                     "without pickling", "store numbers, strings, lists, dicts and tensors only")


def decode(obj: Any, tensors: dict[str, Any]) -> Any:
    """Invert ``encode``."""
    if isinstance(obj, list):
        return list(obj) if _plain(obj) else [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    if _TUPLE in obj:
        items = obj[_TUPLE]
        return tuple(items) if _plain(items) else tuple(decode(v, tensors) for v in items)
    if _ITEMS in obj:
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in obj[_ITEMS]}
    return {k: decode(v, tensors) for k, v in obj.items()}


def references(obj: Any) -> Iterator[str]:
    """The keys of the tensors that ``encode``'s output ``obj`` refers to."""
    if isinstance(obj, list):
        for value in obj:
            yield from references(value)
    elif isinstance(obj, dict):
        if _TENSOR in obj:
            yield obj[_TENSOR]
            return
        for value in obj.values():
            yield from references(value)


_PLAIN = frozenset({type(None), bool, int, float, str})


def _plain(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether every item is a number, string or None (each its own encoding) and a whole
    sequence can be taken at once instead of item by item."""
    return all(type(v) in _PLAIN for v in items)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


# -- random number generators ----------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch (CPU and every CUDA device), numpy, Python ``random``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned (a part this machine lacks, e.g. CUDA, is skipped)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"][:torch.cuda.device_count()]
        for device, device_state in enumerate(cuda):
            torch.cuda.set_rng_state(device_state, device)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
