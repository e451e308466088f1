"""``apex.parallel`` on torch: DDP with Apex's constructor arguments, and SyncBatchNorm."""

from __future__ import annotations

import torch

from mpt.backends.apex import ApexDistributedDataParallel as DistributedDataParallel

SyncBatchNorm = torch.nn.SyncBatchNorm
"""Apex's SyncBatchNorm became torch's (CUDA process groups only)."""

convert_syncbn_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm
"""``apex.parallel.convert_syncbn_model``: torch's converter does the same."""

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model"]
