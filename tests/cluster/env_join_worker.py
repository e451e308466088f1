"""A script that calls both ``init_process_group("env://")`` and ``hvd.init()``, as upstream
scripts run under `mpt launch --backend horovod` do: both must join the one job, with the same
ranks.

usage: env_join_worker.py OUT
"""

import gc
import json
import os
import sys
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
hvd.init()
torch_sum = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(torch_sum)
hvd_sum = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
(Path(sys.argv[1]) / f"rank{dist.get_rank()}.json").write_text(json.dumps({
    "env": {name: int(os.environ[name]) for name in names},
    "torch": [dist.get_rank(), dist.get_world_size(), torch_sum.item()],
    "horovod": [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.cross_rank(), hvd_sum.item()],
}))
dist.destroy_process_group()
gc.collect()  # gloo's work objects, freed at teardown, can abort the exit
hvd.shutdown()
