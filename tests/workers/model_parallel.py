"""The seeds' model parallelism inside a process: a model whose two halves the script put on two
GPUs, set up under ddp (DDP with device_ids=None), trained, and compared with the same model on
one device in plain torch. Rank r uses GPUs 2r and 2r+1; rank 0 writes OUT (JSON): the largest
difference of the final weights from the reference's.

usage: model_parallel.py OUT
"""

import json
import sys

import torch
from torch import nn

import mpt

STEPS, BATCH = 5, 8


class TwoGPUs(nn.Module):
    def __init__(self, first: torch.device, second: torch.device) -> None:
        super().__init__()
        self.first, self.second = first, second
        self.a = nn.Sequential(nn.Linear(8, 32), nn.ReLU()).to(first)
        self.b = nn.Linear(32, 1).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x.to(self.first)).to(self.second))


rt = mpt.Runtime()
first, second = torch.device("cuda", 2 * rt.local_rank), torch.device("cuda", 2 * rt.local_rank + 1)
torch.manual_seed(0)
model = TwoGPUs(first, second)
reference = TwoGPUs(torch.device("cuda", 0), torch.device("cuda", 0))
reference.load_state_dict(model.state_dict())
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
assert {p.device for p in model.parameters()} == {first, second}, "the halves were moved"
assert isinstance(model, nn.parallel.DistributedDataParallel), "not wrapped by DDP"
opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
for _ in range(STEPS):
    x = torch.randn(BATCH * rt.world_size, 8, generator=g)
    y = torch.randn(BATCH * rt.world_size, 1, generator=g)
    mine = slice(rt.rank * BATCH, (rt.rank + 1) * BATCH)
    loss = nn.functional.mse_loss(model(x[mine]), y[mine].to(second))
    rt.backward(loss)
    rt.step()
    nn.functional.mse_loss(reference(x), y.to(reference.second)).backward()
    opt_ref.step()
    opt_ref.zero_grad()
got = rt.backend.unwrap(model).state_dict()
diff = max((got[k].cpu() - v.cpu()).abs().max().item() for k, v in reference.state_dict().items())
if rt.rank == 0:
    with open(sys.argv[1], "w") as out:
        json.dump({"diff": diff}, out)
rt.close()
