"""Apex's opt levels O0-O3 and their overrides, resolved once into one validated ``AmpConfig``.

The rules follow ``apex.amp.frontend``: each level fills in every property, the user's overrides
replace some, and the combinations Apex refused (e.g. casting the model under O1, where casts go
around torch functions instead) are refused here too, as one-line ``UsageError``\\s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mpt.errors import UsageError
from mpt.parse import parse_bool
from mpt.precision.mixed import LossScaleConfig

OPT_LEVELS = {
    "O0": "fp32 training",
    "O1": "autocast (fp16) around torch functions, fp32 weights, dynamic loss scaling",
    "O2": "model cast to fp16, batchnorm fp32, fp32 master weights, dynamic loss scaling",
    "O3": "pure fp16, static loss scale 1.0",
}
"""Apex's opt levels and what each means."""

OVERRIDES = ("cast_model_type", "keep_batchnorm_fp32", "master_weights", "loss_scale",
             "cast_model_outputs")
"""Properties a user may set on top of an opt level (Apex's names)."""

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


@dataclass(frozen=True, kw_only=True, slots=True)
class AmpConfig:
    """Everything an opt level decides, after overrides."""

    opt_level: str
    """``O0`` .. ``O3``."""
    low_dtype: torch.dtype = torch.float16
    """The reduced precision of this run: fp16 (Apex's) or bf16 (the ``-bf16`` variants)."""
    cast_model_type: torch.dtype | None = None
    """dtype the model's weights are cast to; None leaves them as they are (O1)."""
    patch_torch_functions: bool = False
    """Run the forward under autocast (what O1's patched torch functions did)."""
    keep_batchnorm_fp32: bool | None = None
    """Leave batchnorm weights and running stats in fp32 when the model is cast."""
    master_weights: bool = False
    """Keep fp32 copies of the cast weights; the optimizer steps those."""
    loss_scale: str | float = 1.0
    """``"dynamic"`` or a static scale."""
    cast_model_outputs: torch.dtype | None = None
    """dtype of a cast model's outputs (fp32 unless set, as in Apex)."""

    @property
    def name(self) -> str:
        """The ``--precision`` name: ``O2``, or ``O2-bf16`` for the bf16 variant."""
        return self.opt_level + ("-bf16" if self.low_dtype == torch.bfloat16 else "")

    @property
    def casts_model(self) -> bool:
        return self.cast_model_type not in (None, torch.float32)

    def loss_scale_config(self, base: LossScaleConfig) -> LossScaleConfig:
        """Scaling settings: ``loss_scale`` decides dynamic vs static, ``base`` the schedule."""
        if self.loss_scale == "dynamic":
            return base if base.dynamic else LossScaleConfig()
        return LossScaleConfig(dynamic=False, init_scale=float(self.loss_scale),
                               growth_factor=base.growth_factor,
                               backoff_factor=base.backoff_factor,
                               growth_interval=base.growth_interval)

    @classmethod
    def resolve(cls, opt_level: str, overrides: Mapping[str, Any] | None = None, *,
                low_dtype: torch.dtype = torch.float16,
                flag_loss_scale: LossScaleConfig | None = None) -> AmpConfig:
        """The level's properties with ``overrides`` applied, or a UsageError.

        ``flag_loss_scale`` is `--loss-scale`'s value: a static number there replaces the level's
        default scale; its default ("dynamic") does not, so that O3 keeps its static 1.0.
        """
        overrides = dict(overrides or {})
        level = _check_level(opt_level)
        unknown = sorted(set(overrides) - set(OVERRIDES))
        if unknown:
            raise UsageError("amp override", unknown[0], "Apex has no such property",
                             f"use one of {', '.join(OVERRIDES)}")
        low_half = low_dtype
        defaults: dict[str, Any] = {
            "O0": {"cast_model_type": torch.float32, "loss_scale": 1.0},
            "O1": {"patch_torch_functions": True, "loss_scale": "dynamic"},
            "O2": {"cast_model_type": low_half, "keep_batchnorm_fp32": True,
                   "master_weights": True, "loss_scale": "dynamic"},
            "O3": {"cast_model_type": low_half, "keep_batchnorm_fp32": False,
                   "loss_scale": 1.0},
        }[level]
        if low_dtype == torch.bfloat16:
            defaults["loss_scale"] = 1.0  # bf16 has fp32's exponent range: nothing underflows
        if flag_loss_scale is not None and not flag_loss_scale.dynamic:
            defaults["loss_scale"] = flag_loss_scale.init_scale
        given = {k: _parse(k, v) for k, v in overrides.items() if v is not None}
        _check_o1(level, given)
        config = cls(opt_level=level, low_dtype=low_dtype, **{**defaults, **given})
        config._check()
        return config

    def _check(self) -> None:
        if self.opt_level == "O3" and self.master_weights:
            raise UsageError("master_weights", True, "O3 is pure fp16 training, without master "
                             "weights", "use opt_level='O2' with keep_batchnorm_fp32=False for a "
                             "fully cast model with fp32 master weights")
        if self.master_weights and not self.casts_model:
            raise UsageError("master_weights", True, f"{self.opt_level} keeps the model in fp32, "
                             "so there is nothing to keep master copies of",
                             "use opt_level='O2', or drop master_weights")
        scaled = self.loss_scale == "dynamic" or float(self.loss_scale) != 1.0
        if self.low_dtype == torch.bfloat16 and scaled:
            raise UsageError("loss_scale", self.loss_scale, "bf16 needs no loss scaling",
                             "drop loss_scale, or use the fp16 opt level")
        if (self.cast_model_type == torch.float16 and not self.master_weights
                and self.loss_scale == "dynamic"):
            raise UsageError("loss_scale", "dynamic", "dynamic loss scaling of fp16 weights needs "
                             "fp32 master weights (the scaler unscales fp32 gradients only)",
                             "set master_weights=True (opt_level='O2') or a static loss_scale")


def _check_level(opt_level: str) -> str:
    if opt_level in OPT_LEVELS:
        return opt_level
    hint = "use O0 (fp32), O1 (autocast), O2 (fp16 model, fp32 masters) or O3 (pure fp16)"
    if isinstance(opt_level, str) and opt_level in ("00", "01", "02", "03"):
        hint = f"the first character is the letter O, not the digit zero: use 'O{opt_level[1]}'"
    raise UsageError("opt_level", opt_level, "unknown opt level", hint)


def _check_o1(level: str, given: Mapping[str, Any]) -> None:
    """Apex's O1 refusals: O1 casts around functions, so the weights themselves stay fp32."""
    if level != "O1":
        return
    if given.get("cast_model_type") not in (None, torch.float32):
        raise UsageError("cast_model_type", given["cast_model_type"], "O1 inserts casts around "
                         "torch functions rather than casting the model weights",
                         "use opt_level='O2' or 'O3' to cast the model")
    for name in ("keep_batchnorm_fp32", "master_weights"):
        if name in given:
            raise UsageError(name, given[name], "with O1 the model weights stay fp32, so this "
                             "property does not apply", f"drop {name}, or use opt_level='O2'")


def _parse(name: str, value: Any) -> Any:
    """An override as given in code (Python values) or as text (flags, environment)."""
    if name in ("cast_model_type", "cast_model_outputs"):
        if isinstance(value, torch.dtype):
            return value
        key = str(value).removeprefix("torch.")
        if key not in _DTYPES:
            raise UsageError(name, value, "not a floating dtype",
                             "use torch.float16, torch.bfloat16 or torch.float32")
        return _DTYPES[key]
    if name in ("keep_batchnorm_fp32", "master_weights"):
        return parse_bool(name, value)
    # loss_scale: "dynamic" or a number, as --loss-scale takes it
    scale = LossScaleConfig.parse(value if isinstance(value, str) else float(value))
    return "dynamic" if scale.dynamic else scale.init_scale
