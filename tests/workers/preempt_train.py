"""Train slowly until preempted: writes OUT/pids (both ranks) and OUT/step5 once past step 5."""

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import mpt

out = Path(sys.argv[1])
rt = mpt.Runtime()
with open(out / "pids", "a") as f:
    f.write(f"{os.getpid()}\n")
torch.manual_seed(0)
model = nn.Linear(4, 1)
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
step = rt.resume()["step"]
while step < 100_000:
    rt.backward(model(torch.ones(2, 4)).sum())
    rt.step()
    step += 1
    if step == 5 and rt.rank == 0:
        (out / "step5").touch()
    time.sleep(0.02)
rt.close()
