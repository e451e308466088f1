"""An mpt checkpoint written in another framework's format, for a plain script to go on with.

- ``torch``: one ``torch.save`` file ``{"model", "optimizer", "scheduler", "step", "epoch"}``
  (and ``scaler``, a GradScaler's state, where the run scaled its loss), the optimizer's state
  numbered in the order its param groups list the parameters: what ``model.load_state_dict``
  and ``optimizer.load_state_dict`` of a script that built the same optimizer take;
- ``dcp``: a torch.distributed.checkpoint directory ``{"model", "optimizer", "lr_scheduler",
  "train_state": {"step", "epoch"}}`` in ``get_state_dict``'s form, which a plain FSDP2 or DDP
  script's ``dcp.load`` + ``set_state_dict`` resumes at any world size;
- ``safetensors``: the model's weights under their own names, one file.

Only checkpoints of one model export (a plain script has one).
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from mpt.checkpoint import contents
from mpt.checkpoint.encode import decode
from mpt.errors import UsageError
from mpt.state.named import from_named

FORMATS = ("torch", "dcp", "safetensors")


def export(src: str | os.PathLike[str], dst: Path, to: str) -> str:
    """Write the mpt checkpoint at ``src`` (a root or one checkpoint) as ``to`` at ``dst``;
    return a line saying what was written. ``dst`` appears whole or not at all."""
    if to not in FORMATS:
        raise UsageError("--to", to, "no such format", f"pass one of mpt, {', '.join(FORMATS)}")
    found = contents.read(src)
    models = found.state["models"]
    if len(models) != 1:
        raise UsageError("SRC", found.location.url, f"it holds {len(models)} models "
                         f"({', '.join(models)}); a plain script's checkpoint holds one",
                         "export a checkpoint of one model")
    name = models[0]
    weights = {key.split("/", 1)[1]: t for key, t in found.model.items()}
    saved = found.state["optimizers"].get(name)
    optimizer = None if saved is None else decode(saved, found.tensors)
    schedulers = found.state["schedulers"]
    if len(schedulers) > 1:
        raise UsageError("SRC", found.location.url, f"it holds {len(schedulers)} LR schedulers "
                         f"({', '.join(schedulers)}); a plain script's checkpoint holds one",
                         "export a checkpoint of one scheduler")
    scheduler = decode(next(iter(schedulers.values())), found.tensors) if schedulers else None
    scaler = decode(found.state["precision"], found.tensors).get("scaler")
    step, epoch = found.manifest.step, found.manifest.epoch
    if to == "torch":
        blob = {"model": weights, "step": step, "epoch": epoch}
        blob.update({key: value for key, value in (
            ("optimizer", None if optimizer is None else from_named(optimizer, [
                name for group in optimizer["param_groups"] for name in group["params"]])),
            ("scheduler", scheduler), ("scaler", scaler)) if value is not None})
        _commit(dst, lambda path: torch.save(blob, path))
    elif to == "dcp":
        blob = {"model": weights, "train_state": {"step": step, "epoch": epoch}}
        blob.update({key: value for key, value in (
            ("optimizer", optimizer), ("lr_scheduler", scheduler)) if value is not None})
        _commit(dst, lambda path: _dcp_save(blob, path))
    else:
        from safetensors.torch import save_file

        _commit(dst, lambda path: save_file(
            {key: t.contiguous() for key, t in weights.items()}, str(path)))
    held = "weights" if to == "safetensors" or optimizer is None else "weights, optimizer"
    lost = "; not the loss scale (a DCP script keeps none)" if to == "dcp" and scaler else ""
    return (f"wrote {dst} ({to}): {held}{', LR scheduler' if scheduler else ''}; "
            f"step {step}{lost}")


def _dcp_save(blob: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(blob, checkpoint_id=str(path), no_dist=True)


def _commit(dst: Path, write: Any) -> None:
    """``write(path)`` a file or directory beside ``dst``, then rename it to ``dst``: a
    failed export leaves nothing at ``dst``, and an existing ``dst`` is refused, not mixed."""
    if dst.exists():
        raise UsageError("DST", dst, "it exists already", "pass a path that does not exist")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.with_name(f".tmp-{dst.name}-{uuid.uuid4().hex[:12]}")
    try:
        write(staging)
        os.replace(staging, dst)
    finally:
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
        elif staging.exists():
            staging.unlink()
