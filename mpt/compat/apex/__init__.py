"""NVIDIA Apex's Python API on native torch, for code written against Apex.

Upstream Apex removed ``amp`` and ``parallel`` in 2025. Legacy code changes only its imports::

    from mpt.compat.apex import amp                      # was: from apex import amp
    from mpt.compat.apex.parallel import DistributedDataParallel as DDP

Covered: ``amp``, ``parallel`` (DistributedDataParallel, SyncBatchNorm, convert_syncbn_model),
``fp16_utils``, ``optimizers`` (FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad) and
``multi_tensor_apply``; where NVIDIA Apex imports with its CUDA extensions, its own optimizers,
applier and fp16_utils are used.
"""

from mpt.compat.apex import amp, fp16_utils, multi_tensor_apply, optimizers, parallel

__all__ = ["amp", "fp16_utils", "multi_tensor_apply", "optimizers", "parallel"]
