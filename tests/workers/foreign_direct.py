"""An mpt run that loads another framework's checkpoint as it is (``rt.load(SRC)``) and says
what it restored (started by test_foreign_direct.py through `mpt launch`, not a test).

usage: mpt launch ... foreign_direct.py SRC OUT [EXPECTED]
The plain scripts' model, AdamW and warm-up schedule (``foreign_common``); after the load,
every rank's whole weights and optimizer state are gathered (collectives) and rank 0 writes
OUT/direct-<backend>-<world size>.json: the step, the learning rate, the bytes ranks 0 and 1
wrote to disk during the load (``/proc/self/io``), the bytes each rank read from SRC's files
with ``os.preadv`` (how a source's blobs and pieces are read: counted by a wrapper, since a
state this small is lost in ``rchar``'s other reads), and, where EXPECTED (the source's own
full fp32 weights or masters and Adam moments, ``expected.pt``) is given, the names of every
tensor that differs from it (none: bit for bit) and of every parameter whose moments some rank
compared (all of them; under a pipeline each rank holds its stage's).
"""

import json
import os
import sys
from pathlib import Path

import torch
from foreign_common import make_adamw, make_split_model, make_warmup

import mpt

src, out = sys.argv[1], Path(sys.argv[2])
expected_file = sys.argv[3] if len(sys.argv) > 3 else None
rt = mpt.Runtime()
model = make_split_model()
model, optimizer = rt.setup(model, make_adamw(model))
scheduler = make_warmup(optimizer)


def written() -> int:
    """Bytes this process has had written to disk so far (``/proc/self/io``)."""
    lines = Path("/proc/self/io").read_text().splitlines()
    return next(int(line.split()[1]) for line in lines if line.startswith("write_bytes:"))


source, read, preadv = Path(src).resolve(), [0], os.preadv


def counted_preadv(fd: int, buffers: list, offset: int) -> int:
    """``os.preadv``, adding what it read from a file of the source to ``read``."""
    n = preadv(fd, buffers, offset)
    if Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(source):
        read[0] += n
    return n


os.preadv = counted_preadv
before = written()
info = rt.load(src, scheduler=scheduler)
os.preadv = preadv
wrote = rt.backend.broadcast_object(written() - before, src=1) + written() - before
reads = [rt.backend.broadcast_object(read[0], src=r) for r in range(rt.world_size)]
weights = rt.model_state_dict(model)  # whole, on every rank, under any layout
state = rt.backend.optimizer_state_dict(model, optimizer)["state"]  # a pipeline stage's only
differ, moments = [], []
if expected_file is not None:
    expected = torch.load(expected_file, weights_only=True)
    for name, want in expected["fp32"].items():
        if not torch.equal(weights[name].float(), want):
            differ.append(name)
        if name in state:
            moments.append(name)
            for key in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(state[name][key], expected[key][name]):
                    differ.append(f"{name}/{key}")
said = [None] * rt.world_size
torch.distributed.all_gather_object(said, (differ, moments))
if rt.rank == 0:
    (out / f"direct-{rt.backend.name}-{rt.world_size}.json").write_text(json.dumps(
        {"step": info["step"], "lr": scheduler.get_last_lr(), "wrote": wrote, "read": reads,
         "differ": sorted({n for d, _ in said for n in d}),
         "moments": sorted({n for _, m in said for n in m})}))
rt.close()
