"""A channels_last conv model under the horovod backend: non-contiguous weights, gradients and
optimizer state go through Horovod's broadcast and allreduce.

usage: hvd_channels_last.py OUT_DIR
Each rank builds the model from its own seed and steps its optimizer once on its own data before
``rt.setup`` (so weights and momentum differ until the broadcast), then trains 2 steps on its
half of each global batch. It writes OUT_DIR/rank{r}.pt with the weights before and after
``rt.setup``, the momentum after it, the weights after the steps, whether each 4-d weight is still
channels_last after a save and a load (``loaded``: the weights then), and ``replay``: the same
2 steps in this one process on the whole global batch, from the weights and momentum
``rt.setup`` gave it (what averaged gradients must reach).
"""

import copy
import sys
from pathlib import Path

import torch
from torch import nn

import mpt

STEPS, PER_RANK = 2, 4
out = Path(sys.argv[1])
rt = mpt.Runtime()
torch.manual_seed(rt.rank)  # different weights and data on each rank
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
model = model.to(memory_format=torch.channels_last)
assert not model[0].weight.is_contiguous()  # what Horovod refused
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
nn.functional.mse_loss(model(torch.randn(2, 3, 8, 8)), torch.randn(2, 2)).backward()
optimizer.step()  # a momentum buffer of each weight's layout, different on each rank
optimizer.zero_grad()
assert not optimizer.state[model[0].weight]["momentum_buffer"].is_contiguous()
record: dict = {"before": [p.detach().clone() for p in model.parameters()]}

model, optimizer = rt.setup(model, optimizer)
record["setup"] = [p.detach().clone() for p in model.parameters()]
record["momentum"] = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
replica = copy.deepcopy(model)
replica_opt = torch.optim.SGD(replica.parameters(), lr=0.1, momentum=0.9)
replica_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # not shared

g = torch.Generator().manual_seed(100)  # the same global batches on every rank
batches = [(torch.randn(2 * PER_RANK, 3, 8, 8, generator=g).contiguous(
    memory_format=torch.channels_last), torch.randn(2 * PER_RANK, 2, generator=g))
    for _ in range(STEPS)]
for x, y in batches:
    mine = slice(rt.rank * PER_RANK, (rt.rank + 1) * PER_RANK)
    rt.backward(nn.functional.mse_loss(model(x[mine]), y[mine]))
    rt.step()
    nn.functional.mse_loss(replica(x), y).backward()  # the mean of the two ranks' losses
    replica_opt.step()
    replica_opt.zero_grad()
record["trained"] = [p.detach().clone() for p in model.parameters()]
record["replay"] = [p.detach().clone() for p in replica.parameters()]
rt.save(out / "ckpt")
with torch.no_grad():
    for p in model.parameters():
        p.zero_()  # so that a load that does nothing cannot pass
rt.load(out / "ckpt")  # the load broadcasts weights and optimizer state from rank 0 again
record["loaded"] = [p.detach().clone() for p in model.parameters()]
record["channels_last"] = [p.is_contiguous(memory_format=torch.channels_last)
                           for p in model.parameters() if p.dim() == 4]
torch.save(record, out / f"rank{rt.rank}.pt")
rt.close()
