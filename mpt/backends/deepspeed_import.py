"""Full fp32 weights out of a DeepSpeed ZeRO checkpoint directory (``engine.save_checkpoint``).

DeepSpeed's own ``zero_to_fp32`` merges the per-rank shards of any stage and world size; it is
used as it is. What it does not do is read safely: it calls ``torch.load(weights_only=False)``,
which would run whatever a planted pickle says. Its reads are therefore forced to
``weights_only=True`` (torch's documented override, ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, checked at
every ``torch.load``), with only the three plain DeepSpeed classes its files hold allowed in.
The optimizer's moments are not imported: DeepSpeed stores them as flat per-rank partitions
whose unflattening it offers only through its multi-process universal-checkpoint tool.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mpt.errors import UsageError

_ALLOWED = (("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
            ("deepspeed.utils.tensor_fragment", "fragment_address"),
            ("deepspeed.runtime.zero.config", "ZeroStageEnum"))
"""Classes in DeepSpeed's optimizer files: plain data (a scaler's numbers, an offset pair, an
enum); unpickling them sets attributes and runs none of their code."""


def is_zero_checkpoint(src: Path) -> bool:
    """Whether ``src`` looks like what ``engine.save_checkpoint`` writes: a ``latest`` file or
    a tag folder holding ``*_model_states.pt``."""
    if (src / "latest").is_file():
        return True
    return any(src.glob("*_model_states.pt")) or any(src.glob("*/*_model_states.pt"))


@contextlib.contextmanager
def _weights_only_loads(classes: list[Any]) -> Iterator[None]:
    """Every ``torch.load`` inside refuses pickled code, whatever its caller asked for."""
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        with torch.serialization.safe_globals(classes):
            yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def read_zero_checkpoint(src: Path, tag: str | None = None) -> tuple[dict[str, torch.Tensor],
                                                                     int | None]:
    """Full fp32 weights and buffers by name, and the step its tag names (``global_stepN``).

    ``tag``: the tag folder to read; None reads the one the ``latest`` file names.
    """
    import importlib

    from mpt.backends.deepspeed import _import_deepspeed

    _import_deepspeed("cuda" if torch.cuda.is_available() else "cpu")  # or MissingDependencyError
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    classes = []
    for module, name in _ALLOWED:
        with contextlib.suppress(ImportError, AttributeError):  # moved in another version
            classes.append(getattr(importlib.import_module(module), name))
    if tag is None and not (src / "latest").is_file():
        raise UsageError("SRC", src, "it has no 'latest' file naming the tag to read",
                         "pass --tag global_stepN (one of its folders)")
    if tag is None:
        tag = (src / "latest").read_text().strip()
    try:
        with _weights_only_loads(classes):
            weights = get_fp32_state_dict_from_zero_checkpoint(str(src), tag=tag)
    except Exception as exc:  # DeepSpeed and torch raise many types for a bad directory
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError("SRC", src, f"reading it as a DeepSpeed ZeRO checkpoint (tag {tag}) "
                         f"failed: {reason}", "pass the folder engine.save_checkpoint wrote, "
                         "with all its ranks' files") from None
    match = re.fullmatch(r"global_step(\d+)", tag)
    tensors = {name: (t.float() if t.is_floating_point() else t).detach().contiguous()
               for name, t in weights.items() if isinstance(t, torch.Tensor)}
    return tensors, None if match is None else int(match.group(1))
