"""``apex.parallel`` on torch: DDP with Apex's constructor arguments, and SyncBatchNorm."""

from __future__ import annotations

import atexit
import gc

import torch

from mpt.backends.apex import ApexDistributedDataParallel as DistributedDataParallel

SyncBatchNorm = torch.nn.SyncBatchNorm
"""Apex's SyncBatchNorm became torch's (CUDA process groups only)."""

convert_syncbn_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm
"""``apex.parallel.convert_syncbn_model``: torch's converter does the same."""

# Legacy scripts manage their own process group, and gloo's finished work objects sit in
# reference cycles: freed at interpreter teardown they abort the process now and then (see
# DDPBackend.shutdown). Collect them at exit, while Python is whole.
atexit.register(gc.collect)

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model"]
