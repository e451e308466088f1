"""Tensors held as ZeRO-style flat ranges, through mpt's DCP storage on real ranks.

usage: mpt launch --gpus N flat_pieces.py DIR save|load

save: each rank holds its range of every tensor of SHAPES, cut as ZeRO-3 cuts its partitions
(equal ranges of ceil(numel / N), the last padded), and writes it with mpt.checkpoint.sharded.
load: at any N, reads the checkpoint three ways (into this rank's ranges of the same cut, whole,
and into DTensor shards of the first dimension) and writes what it got to DIR/rank-R.json.
"""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from mpt.checkpoint import sharded
from mpt.state.flat import FlatPiece, exchange_tails

SHAPES = {"matrix": (7, 5), "odd": (3,), "leading-one": (1, 4, 6), "scalar": (),
          "inner-one": (2, 1, 3), "long": (10,), "wide": (2, 11)}


def value(name: str) -> torch.Tensor:
    """What the saving ranks hold of ``name``, whole: distinct numbers, so a misplaced element
    shows."""
    shape = SHAPES[name]
    base = 1000 * list(SHAPES).index(name)
    return torch.arange(base, base + torch.Size(shape).numel(), dtype=torch.float32).view(shape)


def pieces(fill: bool) -> dict[str, FlatPiece]:
    """This rank's ZeRO-style ranges (the saved values, or zeros to read into)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    found = {}
    for name, shape in SHAPES.items():
        whole = value(name).reshape(-1)
        size = -(-whole.numel() // world)
        partition = torch.zeros(size)  # padded, as ZeRO pads its last partition
        start = rank * size
        count = max(0, min(size, whole.numel() - start))
        if fill:
            partition[:count] = whole[start:start + count]
        found[name] = FlatPiece(shape=torch.Size(shape), flat=partition[:count], start=start)
    return found


def main(directory: Path, mode: str) -> None:
    dist.init_process_group("gloo")
    if mode == "save":
        held = pieces(fill=True)
        exchange_tails(list(held.values()), torch.device("cpu"))
        sharded.save(dict(held), str(directory / "ckpt"))
    else:
        into = pieces(fill=False)
        sharded.load(str(directory / "ckpt"), dict(into))
        whole = sharded.load(str(directory / "ckpt"), {})
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        rows = {name: distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])
                for name, shape in SHAPES.items() if shape}
        sharded.load(str(directory / "ckpt"), dict(rows))
        report = {
            "ranges": {name: [p.start, p.flat.tolist()] for name, p in into.items()},
            "whole": {name: t.tolist() for name, t in whole.items()},
            "rows": {name: [dt.to_local().tolist(), list(dt.full_tensor().shape)]
                     for name, dt in rows.items()},
        }
        (directory / f"rank-{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    gc.collect()  # gloo's work objects, freed at teardown, can abort the exit


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
