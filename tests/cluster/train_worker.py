"""What each rank of a multi-node test runs: the same training loop on its slice of the same
global batches, under the backend and precision `mpt launch` gives it.

usage: train_worker.py OUT STEPS [STOP]
Trains to STEPS (from the checkpoint --resume names, if any); with STOP, saves a checkpoint at
step STOP and stops there. Writes OUT/rank<r>.json: the job as this rank sees it, its loss at
every step, and the full weights at the end. A one-node and a two-node job of the same world
size must write the same files.
"""

import json
import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from common import global_batches, make_model, make_optimizer

import mpt

MICRO = 4  # rows per rank per step

out, steps = Path(sys.argv[1]), int(sys.argv[2])
stop = int(sys.argv[3]) if len(sys.argv) > 3 else None
rt = mpt.Runtime()
model = make_model()
model, optimizer = rt.setup(model, make_optimizer(model))
start = rt.resume()["step"]
losses = {}
for step, (x, y) in enumerate(global_batches(steps, rt.world_size * MICRO)):
    if step < start:
        continue
    if stop is not None and step == stop:
        rt.save(step=step)
        break
    rows = slice(rt.rank * MICRO, (rt.rank + 1) * MICRO)
    with rt.autocast():
        loss = nn.functional.mse_loss(model(x[rows].to(rt.device)), y[rows].to(rt.device))
    rt.backward(loss)
    rt.step()
    losses[step] = loss.item()
full = rt.backend.model_state_dict(model)  # sharding backends keep a piece in the module
w = rt.world
(out / f"rank{rt.rank}.json").write_text(json.dumps({
    "rank": w.rank, "nr": w.nr, "nodes": w.nodes, "world_size": w.world_size,
    "backend": rt.backend.name, "start": start, "losses": losses,
    "params": {name: t.detach().cpu().flatten().tolist() for name, t in full.items()},
}))
rt.close()
