"""A training state read from another framework's checkpoint, and its writing in mpt's format.

Every reader (DeepSpeed, torch.distributed.checkpoint, a torch.save file) returns one
``Imported``: the weights by name, the optimizer state in the by-name form mpt's own
checkpoints hold (``mpt.state.named``), the LR scheduler's state, the loss scale, the step and
epoch, and what the format does not hold. ``write`` commits it as an mpt checkpoint that
``rt.load``/``--resume`` restore under any backend and world size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from mpt.checkpoint import io
from mpt.checkpoint.encode import encode
from mpt.checkpoint.format import CONVERTED, MODEL_FILE, STATE_JSON, STATE_TENSORS
from mpt.checkpoint.state import write_directory
from mpt.precision import LossScaleState

MODEL = "model"
"""The name a one-model run gives its model (``rt.setup``'s default), under which the imported
weights, optimizer and scheduler are written."""
SCHEDULER = "scheduler"
"""The name ``rt.load(..., scheduler=sched)`` gives a single LR scheduler."""
NEVER_HELD = ("the data loader's position", "the RNG states")
"""What none of the imported formats holds in a form mpt can restore."""


@dataclass(kw_only=True)
class Imported:
    """What a foreign checkpoint holds, in mpt's terms."""

    source: str
    """The format and how it was written, for messages (``DeepSpeed ZeRO-2, 2 ranks``)."""
    weights: dict[str, torch.Tensor]
    """Full weights and buffers by the model's own names (fp32 masters where it kept them)."""
    optimizer: dict[str, Any] | None = None
    """``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``, or None."""
    optimizer_kind: str | None = None
    """The torch optimizer class whose state it is (``AdamW``), where it can be told."""
    scheduler: dict[str, Any] | None = None
    """The LR scheduler's ``state_dict()``, or None."""
    loss_scale: LossScaleState | None = None
    """The dynamic loss scale, where the run scaled its loss."""
    precision: str = "fp32"
    """mpt's name of the precision it trained in (informative)."""
    step: int | None = None
    """The training step it was saved at, where it says."""
    epoch: int | None = None
    """The epoch it was saved at, where it says."""
    world_size: int = 1
    """Processes that wrote it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other plain values the script saved beside the state (returned by ``rt.load``)."""
    lacks: list[str] = field(default_factory=lambda: list(NEVER_HELD))
    """What it does not hold, said once at conversion."""

    @property
    def optimizer_held(self) -> str | None:
        """The optimizer state it holds, in words (``AdamW state of 4 parameters``)."""
        if self.optimizer is None:
            return None
        return (f"{self.optimizer_kind or 'optimizer'} state of "
                f"{len(self.optimizer['state'])} parameters")

    def describe(self) -> dict[str, Any]:
        """What it holds, as plain data (``mpt checkpoint inspect``)."""
        optimizer = self.optimizer_held or "none"
        return {"format": self.source, "step": self.step, "epoch": self.epoch,
                "world size": self.world_size, "precision": self.precision,
                "loss scale": 1.0 if self.loss_scale is None else self.loss_scale.scale,
                "parameters": sum(t.numel() for t in self.weights.values()),
                "tensors": len(self.weights), "optimizer": optimizer,
                "scheduler": self.scheduler is not None, "not in it": list(self.lacks)}

    def summary(self) -> str:
        """One line: what was imported."""
        parts = [f"{len(self.weights)} tensors"]
        if self.optimizer_held is not None:
            parts.append(self.optimizer_held)
        if self.scheduler is not None:
            parts.append("LR scheduler")
        if self.loss_scale is not None:
            parts.append(f"loss scale {self.loss_scale.scale:g}")
        return ", ".join(parts)


def as_int(value: Any) -> int | None:
    """A step or epoch a script saved (an int, or a one-element tensor); None otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return int(value.item())
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write(imported: Imported, dst: str | os.PathLike[str], *, step: int,
          source_path: str) -> str:
    """Commit ``imported`` as the mpt checkpoint ``dst/step-<step>/`` (atomically, as
    ``rt.save`` does); return its URL."""
    tensors: dict[str, Any] = {}
    precision: dict[str, Any] = {"skipped_steps": 0}
    if imported.loss_scale is not None:
        precision["scaler"] = imported.loss_scale.state_dict()
    optimizers = {} if imported.optimizer is None else {
        MODEL: encode(imported.optimizer, f"optimizer/{MODEL}", tensors)}
    schedulers = {} if imported.scheduler is None else {
        SCHEDULER: encode(imported.scheduler, f"scheduler/{SCHEDULER}", tensors)}
    extra = {**imported.extra, "converted_from": source_path}
    state = {"models": [MODEL], "optimizers": optimizers,
             "precision": encode(precision, "precision", tensors), "schedulers": schedulers,
             "loaders": {}, "rng": [], "extra": encode(extra, "extra", tensors),
             # what load_checkpoint checks against the run it restores into
             "imported": {"source": imported.source, "optimizers": {
                 MODEL: imported.optimizer_kind} if imported.optimizer_kind else {}}}
    blobs: dict[str, Any] = {MODEL_FILE: {f"{MODEL}/{k}": v for k, v in imported.weights.items()},
                             STATE_TENSORS: tensors, STATE_JSON: json.dumps(state).encode()}
    root = io.Location.parse(dst)
    root.makedirs()
    final = io.step_dir_name(step)
    staging = io.staging_name(step) if root.local else final
    write_directory(root, staging, final, blobs, manifest=dict(
        backend=CONVERTED, world_size=imported.world_size, step=step, epoch=imported.epoch,
        sharded=False, precision=imported.precision,
        loss_scale=1.0 if imported.loss_scale is None else imported.loss_scale.scale,
        parameters=sum(t.numel() for t in imported.weights.values())))
    return root.child(final).url
