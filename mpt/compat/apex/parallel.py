"""``apex.parallel`` on torch: DDP with Apex's constructor arguments, and SyncBatchNorm.

torch's ``SyncBatchNorm`` synchronises only accelerator tensors, and torch's DDP refuses a CPU
module holding one; Apex's examples run here under gloo on CPUs too. ``SyncBatchNorm`` below is a
batch norm with Apex's arguments that reduces the batch statistics itself, on any device: the
per-channel sums, sums of squares and counts go through the autograd-aware
``torch.distributed.nn`` all-reduce, so the backward pass is synchronised as well.
"""

from __future__ import annotations

import atexit
import gc

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mpt.backends.apex import ApexDistributedDataParallel as DistributedDataParallel
from mpt.errors import UsageError


class SyncBatchNorm(_BatchNorm):
    """``apex.parallel.SyncBatchNorm``: batch statistics over every rank of ``process_group``.

    ``channel_last``: inputs are ``(N, ..., C)``; ``fuse_relu``: a ReLU follows the norm.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: dist.ProcessGroup | None = None, channel_last: bool = False,
                 fuse_relu: bool = False) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise UsageError("SyncBatchNorm input", f"{input.dim()}-d", "it needs a batch and a "
                             "channel dimension", "pass (N, C, ...) tensors")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input.movedim(-1, 1) if self.channel_last else input
        out = self._synced(x) if self._needs_sync() else super().forward(x)
        if self.fuse_relu:
            out = torch.relu(out)
        return out.movedim(1, -1) if self.channel_last else out

    def _needs_sync(self) -> bool:
        if not self.training or not dist.is_available() or not dist.is_initialized():
            return False
        return dist.get_world_size(self.process_group) > 1

    def _synced(self, x: torch.Tensor) -> torch.Tensor:
        """Batch norm with mean and variance over the whole job's batch."""
        dims = [d for d in range(x.dim()) if d != 1]
        xf = x.float()
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims),
                           torch.tensor([x.numel() / x.size(1)], device=x.device)])
        total = dist_autograd.all_reduce(local, group=self.process_group or dist.group.WORLD)
        channels = x.size(1)
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels:2 * channels] / count - mean * mean
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                          else self.momentum)
                unbiased = var.detach() * count / max(float(count) - 1, 1.0)
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        shape = [1, channels] + [1] * (x.dim() - 2)
        out = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(x.dtype)


def convert_syncbn_model(module: nn.Module, process_group: dist.ProcessGroup | None = None,
                         channel_last: bool = False) -> nn.Module:
    """``module`` with every batch norm replaced by ``SyncBatchNorm`` (same parameter objects,
    so an optimizer built before still steps them; same running statistics)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats, process_group, channel_last)
        if module.affine:
            sync.weight, sync.bias = module.weight, module.bias
        if module.track_running_stats:
            sync.running_mean, sync.running_var = module.running_mean, module.running_var
            sync.num_batches_tracked = module.num_batches_tracked
        sync.train(module.training)
        return sync
    for name, child in module.named_children():
        module.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return module


# Legacy scripts manage their own process group, and gloo's finished work objects sit in
# reference cycles: freed at interpreter teardown they abort the process now and then (see
# DDPBackend.shutdown). Collect them at exit, while Python is whole.
atexit.register(gc.collect)

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model"]
