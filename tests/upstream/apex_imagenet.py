"""In the shape of Apex's examples/imagenet/main_amp.py (written anew): its imports and guard,
--local_rank, --sync_bn, amp.initialize with keep_batchnorm_fp32 and loss_scale, apex DDP with
delay_allreduce, to_python_float and reduce_tensor; a small ConvNet on random 16x16 images
instead of a torchvision ResNet on ImageNet, on the CPU where there is no GPU.

usage: apex_imagenet.py [--local_rank N] RECORD_DIR [--opt-level O2] [--sync_bn]
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from apex.parallel import DistributedDataParallel as DDP
    from apex.fp16_utils import *
    from apex import amp, optimizers
    from apex.multi_tensor_apply import multi_tensor_applier
except ImportError:
    raise ImportError("Please install apex from https://www.github.com/nvidia/apex to run this example.")  # noqa: E501

parser = argparse.ArgumentParser()
parser.add_argument("record")
parser.add_argument("--local_rank", default=0, type=int)
parser.add_argument("--sync_bn", action="store_true")
parser.add_argument("--opt-level", type=str, default="O2")
parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
parser.add_argument("--loss-scale", type=str, default=None)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

args.distributed = False
if "WORLD_SIZE" in os.environ:
    args.distributed = int(os.environ["WORLD_SIZE"]) > 1
cuda = torch.cuda.is_available()
args.gpu = 0
args.world_size = 1
if args.distributed:
    args.gpu = args.local_rank
    if cuda:
        torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl" if cuda else "gloo", init_method="env://")
    args.world_size = dist.get_world_size()
device = torch.device("cuda", args.gpu) if cuda else torch.device("cpu")
torch.manual_seed(0)

model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 10))
if args.sync_bn:
    import apex
    model = apex.parallel.convert_syncbn_model(model)
model = model.to(device)
args.lr = args.lr * float(args.world_size)
optimizer = optimizers.FusedSGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                  keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                                  loss_scale=args.loss_scale, verbosity=0)
if args.distributed:
    model = DDP(model, delay_allreduce=True)
criterion = nn.CrossEntropyLoss().to(device)


def reduce_tensor(tensor):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= args.world_size
    return rt


g = torch.Generator().manual_seed(1)
images = torch.randn(64, 3, 16, 16, generator=g)
labels = (images[:, 0].mean((1, 2)) > 0).long() + 2 * (images[:, 1].mean((1, 2)) > 0).long()
shard = slice(dist.get_rank() if args.distributed else 0, None, args.world_size)
losses = []
for epoch in range(args.epochs):
    for i in range(0, 32, 8):
        input = images[shard][i:i + 8].to(device)
        target = labels[shard][i:i + 8].to(device)
        output = model(input)
        loss = criterion(output, target)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        reduced_loss = reduce_tensor(loss.data) if args.distributed else loss.data
        losses.append(to_python_float(reduced_loss))
if args.local_rank == 0:
    print(f"final loss {losses[-1]:.4f}, model weights {next(model.parameters()).dtype}")
rank = dist.get_rank() if args.distributed else 0
with open(os.path.join(args.record, f"rank{rank}.json"), "w") as f:
    json.dump({"local_rank": args.local_rank, "losses": losses,
               "sync_bn": type(model.module[1]).__name__ if args.distributed else ""}, f)
if args.distributed:
    dist.destroy_process_group()
