"""Forwards that run in the run's precision with no ``with rt.autocast():`` in the script.

A script written for one device calls ``model(x)`` and computes its loss with no context around
it; under a mixed precision it must still compute in fp16/bf16, or the flag silently trains fp32.
Lightning Fabric wraps the module for this. mpt keeps the object the backend returned (a DDP, an
fsdp module, a DeepSpeed engine, the model itself) and adds two hooks to it instead: the forward
enters ``torch.autocast`` unless its caller already runs under one (``rt.autocast()`` around it
stays valid and adds nothing), and its low-precision outputs leave in fp32 (Fabric's
``convert_output``), so a loss computed outside any context is computed as autocast would
compute it. The hooks are a picklable object, so ``torch.save(model)`` keeps working.

One consequence: ``with torch.autocast(..., enabled=False): model(x)`` cannot tell the hook to
stay off (torch reports a disabled autocast as no autocast); disable it inside the forward, around
the submodule that must run in fp32, as torch's autocast recipe does.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def cast_floats(obj: Any, dtype: torch.dtype, only: torch.dtype | None = None) -> Any:
    """``obj`` with every floating tensor inside (tuples, lists, dicts, named tuples) cast to
    ``dtype``; with ``only``, just the tensors of that dtype."""
    if isinstance(obj, torch.Tensor):
        matches = obj.is_floating_point() and (only is None or obj.dtype == only)
        return obj.to(dtype) if matches else obj
    if isinstance(obj, dict):
        cast = copy.copy(obj)  # the mapping's own type (OrderedDict, a model-output class)
        for key, value in obj.items():
            cast[key] = cast_floats(value, dtype, only)
        return cast
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_floats(v, dtype, only) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(v, dtype, only) for v in obj)
    return obj


class AutocastForward:
    """The two hooks that run a module's forward under ``torch.autocast(device_type, dtype)``.

    ``outputs``: the dtype the forward's ``dtype`` outputs leave in (None: as autocast left
    them), and only where the hook entered autocast itself.
    """

    def __init__(self, device_type: str, dtype: torch.dtype,
                 outputs: torch.dtype | None = torch.float32) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.outputs = outputs
        self._entered: list[torch.autocast | None] = []
        """One entry per forward in flight: the autocast it entered, or None (the caller's)."""

    def attach(self, module: nn.Module) -> nn.Module:
        # First among the pre-hooks, so that the exit below always has its entry, even when a
        # later pre-hook (fsdp's unshard) raises; the exit runs on exceptions too.
        module.register_forward_pre_hook(self.enter, prepend=True)
        module.register_forward_hook(self.leave, always_call=True)
        return module

    def enter(self, _module: nn.Module, _args: Any) -> None:
        if torch.is_autocast_enabled(self.device_type):
            self._entered.append(None)  # the caller's autocast (rt.autocast()) decides
            return
        context = torch.autocast(self.device_type, dtype=self.dtype)
        context.__enter__()
        self._entered.append(context)

    def leave(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        context = self._entered.pop() if self._entered else None
        if context is None:
            return None
        context.__exit__(None, None, None)
        if self.outputs is None or output is None:
            return None
        return cast_floats(output, self.outputs, only=self.dtype)

    def __getstate__(self) -> dict[str, Any]:
        # Nothing in flight travels with a pickled model.
        return {"device_type": self.device_type, "dtype": self.dtype, "outputs": self.outputs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._entered = []
