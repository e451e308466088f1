"""Precision plugins and the registry that maps ``--precision`` names to them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mpt.errors import UsageError
from mpt.precision.amp_config import OPT_LEVELS, AmpConfig
from mpt.precision.apex import ApexPrecision
from mpt.precision.base import FP32Precision, LossScaleState, Precision, PrecisionSpec
from mpt.precision.mixed import LossScaleConfig, MixedPrecision

PrecisionFactory = Callable[[str, LossScaleConfig, Mapping[str, Any]], Precision]
"""Builds a precision for a device type (``"cpu"``, ``"cuda"``), the loss-scale settings and the
precision's own options (Apex's overrides for the opt levels)."""


def _without_options(name: str,
                     make: Callable[[str, LossScaleConfig], Precision]) -> PrecisionFactory:
    """A factory for a precision that has no options: any option given is a usage error."""
    def factory(device_type: str, ls: LossScaleConfig, options: Mapping[str, Any]) -> Precision:
        if options:
            raise UsageError("precision option", next(iter(options)), f"precision {name!r} has "
                             "no options", "use an opt level (O0..O3) for Apex's overrides")
        return make(device_type, ls)
    return factory


def _opt_level(level: str, low_dtype: torch.dtype) -> PrecisionFactory:
    """Apex's ``level`` (with its overrides as options), in fp16 or in bf16."""
    def factory(device_type: str, ls: LossScaleConfig, options: Mapping[str, Any]) -> Precision:
        config = AmpConfig.resolve(level, options, low_dtype=low_dtype, flag_loss_scale=ls)
        return ApexPrecision(device_type, config, ls)
    return factory


PRECISIONS: dict[str, PrecisionFactory] = {
    "fp32": _without_options("fp32", lambda device_type, _: FP32Precision(device_type)),
    "fp16-mixed": _without_options(
        "fp16-mixed", lambda device_type, ls: MixedPrecision(device_type, torch.float16, ls)),
    "bf16-mixed": _without_options(
        "bf16-mixed", lambda device_type, ls: MixedPrecision(device_type, torch.bfloat16, ls)),
    **{level: _opt_level(level, torch.float16) for level in OPT_LEVELS},
    # bf16 variants where a cast model makes sense; O1 in bf16 is bf16-mixed already.
    "O2-bf16": _opt_level("O2", torch.bfloat16),
    "O3-bf16": _opt_level("O3", torch.bfloat16),
}


def check_precision(name: str) -> str:
    """Return ``name`` if it is a known precision, else raise a UsageError listing them."""
    if name not in PRECISIONS:
        raise UsageError("--precision", name, "unknown precision",
                         f"use one of {', '.join(PRECISIONS)}")
    return name


def make_precision(name: str, device_type: str, loss_scale: LossScaleConfig | None = None,
                   options: Mapping[str, Any] | None = None) -> Precision:
    """Instantiate the precision registered as ``name`` with its own ``options``."""
    return PRECISIONS[check_precision(name)](device_type, loss_scale or LossScaleConfig(),
                                              options or {})


def describe(name: str, loss_scale: LossScaleConfig | None = None,
             options: Mapping[str, Any] | None = None) -> PrecisionSpec:
    """What precision ``name`` with these settings does, checked, without a device or a model
    (`mpt launch` asks before any process starts)."""
    return make_precision(name, "cpu", loss_scale, options).spec


__all__ = ["PRECISIONS", "AmpConfig", "ApexPrecision", "FP32Precision", "LossScaleConfig",
           "LossScaleState", "MixedPrecision", "Precision", "PrecisionSpec", "check_precision",
           "describe", "make_precision"]
