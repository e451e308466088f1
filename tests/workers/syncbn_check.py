"""Worker: apex.parallel's SyncBatchNorm on this rank's half of a batch must give what one
BatchNorm gives on the whole batch: outputs, input gradients, summed parameter gradients and
running statistics. Writes OUT_DIR/ok<rank> when they match.

usage: syncbn_check.py OUT_DIR
"""

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mpt.compat.apex.parallel import convert_syncbn_model

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
x = torch.randn(8, 3, 4, 4) * 3 + 1
reference = torch.nn.BatchNorm2d(3)
with torch.no_grad():
    reference.weight.uniform_(0.5, 1.5)
    reference.bias.uniform_(-1, 1)
sync = convert_syncbn_model(torch.nn.Sequential(torch.nn.BatchNorm2d(3)))[0]
sync.load_state_dict(reference.state_dict())
assert type(sync).__name__ == "SyncBatchNorm"

whole = x.clone().requires_grad_()
want = reference(whole)
(want * torch.arange(want.numel()).view_as(want)).sum().backward()  # a non-uniform loss
part = x.chunk(world)[rank].clone().requires_grad_()
got = sync(part)
weights = torch.arange(want.numel()).view_as(want).chunk(world)[rank]
(got * weights).sum().backward()
for grad in (sync.weight.grad, sync.bias.grad):
    dist.all_reduce(grad)  # what DDP does with the parameters' gradients
checks = {
    "output": (got, want.chunk(world)[rank]),
    "input grad": (part.grad, whole.grad.chunk(world)[rank]),
    "weight grad": (sync.weight.grad, reference.weight.grad),
    "bias grad": (sync.bias.grad, reference.bias.grad),
    "running mean": (sync.running_mean, reference.running_mean),
    "running var": (sync.running_var, reference.running_var),
}
for name, (a, b) in checks.items():
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)
Path(sys.argv[1], f"ok{rank}").write_text("ok")
dist.destroy_process_group()
gc.collect()  # gloo's work objects, freed at teardown, can abort the exit
