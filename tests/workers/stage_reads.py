"""Run a training script with this rank's checkpoint traffic recorded.

usage: stage_reads.py REPORT_DIR [--whole-saves] SCRIPT [ARGS...]

Runs SCRIPT (as ``__main__``, with ARGS) in this process. Every read of a sharded checkpoint
(``mpt.checkpoint.sharded.load``) is recorded: REPORT_DIR/reads-rank-R.json maps each key this
rank read to the bytes it holds of it (a ``DTensor``'s local shard, a ``FlatPiece``'s range, a
whole tensor's all) and lists the keys it left unread. REPORT_DIR/saves-rank-R.json counts the
pipeline's gathers of a stage's state over the stages (``Stages.gather``) that ran
inside ``rt.save``. ``--whole-saves``: every ``rt.save`` is ``sharded=False``.
"""

import json
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import mpt
from mpt.checkpoint import sharded
from mpt.pipeline.stages import Stages
from mpt.state.flat import FlatPiece

report = Path(sys.argv[1])
args = sys.argv[2:]
whole_saves = args[:1] == ["--whole-saves"]
if whole_saves:
    args = args[1:]


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def held_bytes(tensor: Any) -> int:
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    elif isinstance(tensor, FlatPiece):
        tensor = tensor.flat
    assert isinstance(tensor, torch.Tensor), type(tensor)
    return tensor.numel() * tensor.element_size()


load = sharded.load


def recorded_load(directory: str, into: Any, **options: Any) -> Any:
    got = load(directory, into, **options)
    (report / f"reads-rank-{rank()}.json").write_text(json.dumps({
        "read": {key: held_bytes(t) for key, t in got.items()
                 if not isinstance(t, sharded.Unread)},
        "unread": sorted(key for key, t in got.items() if isinstance(t, sharded.Unread))}))
    return got


sharded.load = recorded_load

saving = [False]
gathers = [0]
gather = Stages.gather


def counted_gather(self: Stages, local: Any) -> list[Any]:
    gathers[0] += saving[0]
    return gather(self, local)


Stages.gather = counted_gather  # type: ignore[method-assign]
save = mpt.Runtime.save


def recorded_save(self: mpt.Runtime, *positional: Any, **options: Any) -> str:
    saving[0] = True
    try:
        return save(self, *positional, **{**options, **({"sharded": False} if whole_saves
                                                        else {})})
    finally:
        saving[0] = False
        (report / f"saves-rank-{self.rank}.json").write_text(json.dumps(
            {"gathers": gathers[0]}))


mpt.Runtime.save = recorded_save  # type: ignore[method-assign]
sys.argv = args
runpy.run_path(args[0], run_name="__main__")
