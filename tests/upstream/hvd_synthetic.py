"""In the shape of Horovod's examples/pytorch/pytorch_synthetic_benchmark.py (written anew), with
a small convolutional network instead of torchvision's ResNet-50, on the CPU.

usage: hvd_synthetic.py RECORD.json: rank 0 writes images/s and the threads each rank used.
"""

import argparse
import json
import timeit

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn, optim

parser = argparse.ArgumentParser()
parser.add_argument("record")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=3)
parser.add_argument("--num-iters", type=int, default=3)
args = parser.parse_args()

hvd.init()
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                      nn.Flatten(), nn.Linear(256, 100))
lr_scaler = hvd.size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, 32, 32)
target = torch.randint(0, 100, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for _ in range(args.num_iters):
    elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_secs.append(args.batch_size * args.num_batches_per_iter / elapsed)
threads = torch.tensor([float(torch.get_num_threads())])
threads = hvd.allreduce(threads, name="threads")
if hvd.rank() == 0:
    mean = sum(img_secs) / len(img_secs)
    print(f"Total img/sec on {hvd.size()} process(es): {hvd.size() * mean:.1f}")
    with open(args.record, "w") as f:
        json.dump({"img_sec": hvd.size() * mean, "threads": threads.item()}, f)
