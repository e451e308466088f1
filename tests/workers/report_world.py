"""Write what this process believes about the job, and prove the ranks can talk.

usage: report_world.py OUT_DIR [sleep seconds after the report]
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

import mpt

out = Path(sys.argv[1])
rt = mpt.Runtime()
total = rt.all_reduce(torch.tensor([float(rt.rank + 1)]), op="sum")
w = rt.world
(out / f"rank{rt.rank}.json").write_text(json.dumps({
    "rank": w.rank, "local_rank": w.local_rank, "nr": w.nr, "nodes": w.nodes, "gpus": w.gpus,
    "world_size": w.world_size, "source": w.source, "backend": rt.backend.name,
    "precision": rt.precision.name, "sum": total.item(), "pid": os.getpid(),
}))
print(f"report from rank {rt.rank}", flush=True)
if len(sys.argv) > 2:
    time.sleep(float(sys.argv[2]))
rt.close()
