"""``apex.optimizers`` for code written against NVIDIA Apex: the real one where it imports.

Without Apex's CUDA extensions, FusedAdam, FusedSGD and FusedAdagrad are torch's own optimizers
(fused kernels on CUDA, foreach or for-loop elsewhere) with Apex's constructor arguments; torch
has no LAMB or NovoGrad, so FusedLAMB and FusedNovoGrad are short implementations of Apex's
kernels' arithmetic (see ``lamb_novograd``). Each is a real ``torch.optim.Optimizer``: learning
rate schedulers, ``state_dict`` and mpt's checkpoints work with it.
"""

from __future__ import annotations

import importlib
from typing import Any

from mpt.compat.apex.optimizers.lamb_novograd import FusedLAMB, FusedNovoGrad
from mpt.compat.apex.optimizers.torch_backed import FusedAdagrad, FusedAdam, FusedSGD

NAMES = ("FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedNovoGrad")


def _real_apex() -> dict[str, Any]:
    """NVIDIA Apex's own classes, when Apex and its CUDA extensions import here."""
    try:
        module = importlib.import_module("apex.optimizers")
        import amp_C  # noqa: F401 - Apex's kernels: without them its optimizers cannot step
    except (ImportError, RuntimeError, AttributeError):  # absent, or built without extensions
        return {}
    return {name: getattr(module, name) for name in NAMES if hasattr(module, name)}


globals().update(_real_apex())

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]
