"""Precision plugins and the registry that maps ``--precision`` names to them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mpt.errors import UsageError
from mpt.precision.base import FP32Precision, Precision
from mpt.precision.mixed import LossScaleConfig, MixedPrecision

PrecisionFactory = Callable[[str, LossScaleConfig], Precision]
"""Builds a precision for a device type (``"cpu"``, ``"cuda"``) and the loss-scale settings."""

PRECISIONS: dict[str, PrecisionFactory] = {
    "fp32": lambda device_type, _: FP32Precision(device_type),
    "fp16-mixed": lambda device_type, ls: MixedPrecision(device_type, torch.float16, ls),
    "bf16-mixed": lambda device_type, ls: MixedPrecision(device_type, torch.bfloat16, ls),
}


def check_precision(name: str) -> str:
    """Return ``name`` if it is a known precision, else raise a UsageError listing them."""
    if name not in PRECISIONS:
        raise UsageError("--precision", name, "unknown precision",
                         f"use one of {', '.join(PRECISIONS)}")
    return name


def make_precision(name: str, device_type: str,
                   loss_scale: LossScaleConfig | None = None) -> Precision:
    """Instantiate the precision registered as ``name``."""
    return PRECISIONS[check_precision(name)](device_type, loss_scale or LossScaleConfig())


__all__ = ["PRECISIONS", "FP32Precision", "LossScaleConfig", "MixedPrecision", "Precision",
           "check_precision", "make_precision"]
