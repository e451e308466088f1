"""An mpt checkpoint written in another framework's format, for a plain script to go on with.

- ``torch``: one ``torch.save`` file ``{"model", "optimizer", "scheduler", "step", "epoch"}``
  (and ``scaler``, a GradScaler's state, where the run scaled its loss), the optimizer's state
  numbered in the order its param groups list the parameters: what ``model.load_state_dict``
  and ``optimizer.load_state_dict`` of a script that built the same optimizer take;
- ``dcp``: a torch.distributed.checkpoint directory ``{"model", "optimizer", "lr_scheduler",
  "train_state": {"step", "epoch"}}`` in ``get_state_dict``'s form, which a plain FSDP2 or DDP
  script's ``dcp.load`` + ``set_state_dict`` resumes at any world size;
- ``safetensors``: the model's weights under their own names, one file;
- ``deepspeed``: a DeepSpeed checkpoint directory in its universal layout, which
  ``engine.load_checkpoint`` of a plain DeepSpeed script resumes at any world size
  (``mpt.checkpoint.foreign.universal``).

Only checkpoints of one model export (a plain script has one).
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpt.checkpoint import contents
from mpt.checkpoint.encode import decode
from mpt.errors import UsageError
from mpt.state.named import from_named

FORMATS = ("torch", "dcp", "safetensors", "deepspeed")


@dataclass(frozen=True, kw_only=True)
class Run:
    """The training state of an mpt checkpoint of one model, as the export formats take it."""

    location: str
    """The checkpoint directory it was read from."""
    weights: dict[str, torch.Tensor]
    """Full weights and buffers by the model's own names."""
    optimizer: dict[str, Any] | None
    """The optimizer's state by parameter name (``mpt.state.named``), or None."""
    scheduler: dict[str, Any] | None
    """The LR scheduler's ``state_dict()``, or None."""
    scaler: dict[str, Any] | None
    """The loss scale, as ``GradScaler.state_dict()`` lays it out, where the run scaled its
    loss."""
    skipped_steps: int
    """Steps the loss scaler skipped (an overflow)."""
    step: int
    epoch: int | None
    world_size: int
    """Processes that wrote it."""
    extra: dict[str, Any]
    """What ``rt.save`` kept beside the state (``rt.load`` returns it)."""

    def order(self) -> list[str]:
        """The parameter names in the order the optimizer's param groups list them: how torch
        numbers them."""
        assert self.optimizer is not None
        return [name for group in self.optimizer["param_groups"] for name in group["params"]]


def read(src: str | os.PathLike[str]) -> Run:
    """The mpt checkpoint at ``src`` (a root or one checkpoint, whole or sharded); refused
    unless it holds one model and at most one LR scheduler."""
    found = contents.read(src)
    models = found.state["models"]
    if len(models) != 1:
        raise UsageError("SRC", found.location.url, f"it holds {len(models)} models "
                         f"({', '.join(models)}); a plain script's checkpoint holds one",
                         "export a checkpoint of one model")
    name = models[0]
    saved = found.state["optimizers"].get(name)
    schedulers = found.state["schedulers"]
    if len(schedulers) > 1:
        raise UsageError("SRC", found.location.url, f"it holds {len(schedulers)} LR schedulers "
                         f"({', '.join(schedulers)}); a plain script's checkpoint holds one",
                         "export a checkpoint of one scheduler")
    precision = decode(found.state["precision"], found.tensors)
    return Run(location=found.location.url,
               weights={key.split("/", 1)[1]: t for key, t in found.model.items()},
               optimizer=None if saved is None else decode(saved, found.tensors),
               scheduler=decode(next(iter(schedulers.values())), found.tensors)
               if schedulers else None,
               scaler=precision.get("scaler"), skipped_steps=int(precision.get(
                   "skipped_steps", 0)), step=found.manifest.step, epoch=found.manifest.epoch,
               world_size=found.manifest.world_size,
               extra=decode(found.state["extra"], found.tensors))


def export(src: str | os.PathLike[str], dst: Path, to: str) -> str:
    """Write the mpt checkpoint at ``src`` (a root or one checkpoint) as ``to`` at ``dst``;
    return what was written (and, where the format leaves some of the state out, a second line
    saying what). ``dst`` appears whole or not at all."""
    if to not in FORMATS:
        raise UsageError("--to", to, "no such format", f"pass one of mpt, {', '.join(FORMATS)}")
    run = read(src)
    weights, optimizer, scheduler, scaler = run.weights, run.optimizer, run.scheduler, run.scaler
    step, epoch = run.step, run.epoch
    if to == "deepspeed":
        from mpt.checkpoint.foreign import universal

        tag = universal.tag(run)
        _commit(dst, lambda path: universal.write(run, path, tag))
        return universal.said(run, dst, tag)
    if to == "torch":
        blob = {"model": weights, "step": step, "epoch": epoch}
        blob.update({key: value for key, value in (
            ("optimizer", None if optimizer is None else from_named(optimizer, run.order())),
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
