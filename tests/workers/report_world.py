"""Write what this process believes about the job, and prove the ranks can talk.

usage: report_world.py [--local_rank=N] OUT_DIR [sleep seconds after the report]
(``--local_rank``, from `--local-rank-arg`, is printed with the report.)
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import mpt

given = [a for a in sys.argv[1:] if a.startswith("--local_rank=")]
args = [a for a in sys.argv[1:] if a not in given]
out = Path(args[0])
rt = mpt.Runtime()
total = rt.all_reduce(torch.tensor([float(rt.rank + 1)]), op="sum")
w = rt.world
torch_sum = None
if dist.is_initialized():  # every backend starts a torch group (Horovod beside its own)
    torch_sum = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(torch_sum)
    torch_sum = torch_sum.item()
(out / f"rank{rt.rank}.json").write_text(json.dumps({
    "rank": w.rank, "local_rank": w.local_rank, "nr": w.nr, "nodes": w.nodes, "gpus": w.gpus,
    "world_size": w.world_size, "source": w.source, "backend": rt.backend.name,
    "precision": rt.precision.name, "sum": total.item(), "pid": os.getpid(),
    "torch_sum": torch_sum, "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "sampler": list(DistributedSampler(range(6), shuffle=False)) if torch_sum else None,
}))
print(f"report from rank {rt.rank}", *given, flush=True)
if len(args) > 1:
    time.sleep(float(args[1]))
rt.close()
