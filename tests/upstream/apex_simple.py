"""In the shape of Apex's examples/simple/distributed/distributed_data_parallel.py (written anew):
--local_rank from argv, amp O1, apex DDP; on the CPU (gloo) where there is no GPU.

usage: apex_simple.py [--local_rank N] RECORD_DIR: each rank writes its local rank and losses.
"""

import argparse
import json
import os

import torch
from apex import amp
from apex.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", default=0, type=int)
parser.add_argument("record")
args = parser.parse_args()
args.distributed = False
if "WORLD_SIZE" in os.environ:
    args.distributed = int(os.environ["WORLD_SIZE"]) > 1
cuda = torch.cuda.is_available()
device = torch.device("cuda", args.local_rank) if cuda else torch.device("cpu")
if args.distributed:
    if cuda:
        torch.cuda.set_device(args.local_rank)
    torch.distributed.init_process_group(backend="nccl" if cuda else "gloo", init_method="env://")

torch.manual_seed(0)
N, D_in, D_out = 64, 32, 4
x = torch.randn(N, D_in, device=device)
y = torch.randn(N, D_out, device=device)
model = torch.nn.Linear(D_in, D_out).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
if args.distributed:
    model = DistributedDataParallel(model)
loss_fn = torch.nn.MSELoss()
losses = []
for t in range(30):
    optimizer.zero_grad()
    y_pred = model(x)
    loss = loss_fn(y_pred, y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())
rank = torch.distributed.get_rank() if args.distributed else 0
with open(os.path.join(args.record, f"rank{rank}.json"), "w") as f:
    json.dump({"local_rank": args.local_rank, "losses": losses}, f)
if args.local_rank == 0:
    print("final loss = ", loss.item())
if args.distributed:
    torch.distributed.destroy_process_group()
