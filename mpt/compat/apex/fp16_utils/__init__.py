"""``apex.fp16_utils`` (manual fp16 training: master weights, loss scalers, FP16_Optimizer).

Apex's own module is used where NVIDIA Apex imports with it; else mpt's, on plain torch, with
Apex's names and arguments (``from apex.fp16_utils import *`` scripts find the same names).
"""

from __future__ import annotations

import importlib

from mpt.compat.apex.fp16_utils.fp16_optimizer import FP16_Optimizer
from mpt.compat.apex.fp16_utils.fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from mpt.compat.apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["BN_convert_float", "DynamicLossScaler", "FP16Model", "FP16_Optimizer", "LossScaler",
           "clip_grad_norm", "convert_module", "convert_network",
           "master_params_to_model_params", "model_grads_to_master_grads", "network_to_half",
           "prep_param_lists", "to_python_float", "tofp16"]

try:  # NVIDIA Apex's own, where it still ships it (releases before 2025)
    _apex = importlib.import_module("apex.fp16_utils")
except (ImportError, RuntimeError):
    _apex = None
if _apex is not None:
    globals().update({name: getattr(_apex, name) for name in __all__ if hasattr(_apex, name)})
