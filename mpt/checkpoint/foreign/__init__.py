"""Other frameworks' checkpoints, read with their whole training state into mpt's format.

``read(path)`` tells the format by its layout and returns an ``Imported`` (weights, optimizer
state by parameter name, LR scheduler, loss scale, step, epoch); ``write`` commits that as an
mpt checkpoint, which ``rt.load`` and ``--resume`` restore under any backend and world size.
``mpt checkpoint convert`` is the two together; ``load`` (``rt.load``/``--resume`` of the
source itself) restores the ``Imported`` straight into the run (``restore``), each rank reading
only its own pieces where it holds pieces. Every read is safe: no pickled code runs.
Hugging Face safetensors weights come in the same way, as initial weights (``hf``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpt.checkpoint.foreign.imported import Imported, write
from mpt.errors import UsageError

if TYPE_CHECKING:
    from mpt.checkpoint.state import TrainingState

__all__ = ["KNOWN", "Imported", "detect", "is_foreign", "load", "read", "write"]

KNOWN = ("a DeepSpeed checkpoint directory (engine.save_checkpoint: 'latest' and "
         "*_model_states.pt)", "a torch.distributed.checkpoint directory (dcp.save: .metadata "
         "and *.distcp)", "a torch.save file (.pt)", "Hugging Face safetensors weights (a "
         ".safetensors file, or a save_pretrained directory: model.safetensors.index.json and "
         "its shards)")
"""The formats ``read`` knows, for messages (mpt's own checkpoints are read by ``rt.load``)."""
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def detect(src: Path) -> str:
    """``deepspeed``, ``dcp``, ``torch`` or ``hf``: the format of ``src``; a UsageError listing
    the known ones where it is none of them. Each reader's module is imported only once the
    ones before it said no: ``dcp``'s imports torch.distributed.checkpoint, 0.7 s of a DeepSpeed
    conversion's few seconds where it came first."""
    from mpt.checkpoint.foreign import deepspeed, hf, torchload

    if src.is_dir():
        if deepspeed.is_deepspeed(src):
            return "deepspeed"
        from mpt.checkpoint.foreign import dcp

        if dcp.is_dcp(src):
            return "dcp"
    if hf.is_hf(src):
        return "hf"
    if src.is_file() and (torchload.is_torch_file(src) or src.suffix in _TORCH_SUFFIXES):
        return "torch"  # a zip-format file, or one of torch's older format under its usual name
    what = "no such file or directory" if not src.exists() else "it is in no format mpt imports"
    raise UsageError("SRC", src, what, f"pass {'; '.join(KNOWN)}")


def read(src: Path, *, tag: str | None = None, optimizer: bool = True) -> Imported:
    """The training state of the checkpoint at ``src``, whichever format ``detect`` finds.
    ``tag``: the DeepSpeed tag folder to read (default: the one ``latest`` names).
    ``optimizer``: False leaves the optimizer's state unread (``--weights-only``)."""
    kind = detect(src)
    if tag is not None and kind != "deepspeed":
        raise UsageError("--tag", tag, f"{src} is not a DeepSpeed checkpoint, which alone has "
                         "tags", "leave --tag out")
    if kind == "deepspeed":
        from mpt.checkpoint.foreign import deepspeed

        imported = deepspeed.read(src, tag, optimizer=optimizer)
    elif kind == "dcp":
        from mpt.checkpoint.foreign import dcp

        imported = dcp.read(src, optimizer=optimizer)
    elif kind == "hf":
        from mpt.checkpoint.foreign import hf

        return hf.read(src)  # weights only, said in its lacks
    else:
        from mpt.checkpoint.foreign import torchfile

        imported = torchfile.read(src, optimizer=optimizer)
    if not optimizer:
        imported.lacks.insert(0, "the optimizer's state (--weights-only)")
    return imported


def is_foreign(src: str | os.PathLike[str]) -> bool:
    """Whether ``src`` is a local checkpoint in a format ``read`` knows."""
    try:
        detect(Path(src))
    except UsageError:
        return False
    return True


def load(src: str | os.PathLike[str], parts: TrainingState,
         say: Callable[[str], None]) -> dict[str, Any]:
    """``rt.load``/``--resume`` of another framework's checkpoint: read and restored as `mpt
    checkpoint convert` then ``--resume`` would, with no copy on disk (``restore``). Every rank
    reads the source's layout itself; where the run's ranks hold pieces of the state, each
    reads only its own pieces of the tensors a reader leaves in the source's files (ZeRO's
    partitions, DCP's chunks) and slices the others (a torch file's, mapped)."""
    from mpt.checkpoint.foreign import restore

    imported = read(Path(src))
    info = restore.load(imported, parts, os.fspath(src))
    say(f"mpt: imported {src} ({imported.source}): {imported.summary()}; it does not hold "
        f"{', '.join(imported.lacks)}, which start afresh")
    return info
