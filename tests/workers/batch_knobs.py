"""Worker: report what --global-batch-size and --lr-scaling gave this rank.

argv: OUT_DIR MICRO_BATCH. Writes OUT_DIR/rank{r}.json with the runtime's batch size,
accumulation, scaled lr, the shard sizes the loader produced, whether a training DataLoader with
the wrong batch size was refused, and the first batch of an evaluation loader of another size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import mpt

out, micro = Path(sys.argv[1]), int(sys.argv[2])
with mpt.Runtime(batch_size=micro) as rt:
    data = TensorDataset(torch.arange(64, dtype=torch.float32))
    try:
        rt.setup_dataloader(DataLoader(data, batch_size=micro + 1))  # the first: "train"
        refused = ""
    except mpt.UsageError as exc:
        refused = str(exc)
    loader = rt.setup_dataloader(DataLoader(data, batch_size=rt.batch_size), name="train")
    evaluation = rt.setup_dataloader(DataLoader(data, batch_size=10))  # any size: not "train"
    (out / f"rank{rt.rank}.json").write_text(json.dumps({
        "batch_size": rt.batch_size, "accumulate": rt.accumulate, "lr": rt.scale_lr(0.1),
        "first_batch": len(next(iter(loader))[0]), "refused": refused,
        "eval_batch": len(next(iter(evaluation))[0]), "eval_name": evaluation.name}))
