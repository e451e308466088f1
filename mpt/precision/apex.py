"""Apex's opt levels on native torch: casts, fp32 master weights and loss scaling.

O1 is ``torch.autocast`` (what Apex's patched torch functions became upstream). O2/O3 cast the
model itself; O2 keeps an fp32 master copy of every cast weight, which the optimizer steps and
which is copied back into the model after each step, so small updates are not lost to fp16
rounding. Scaling reuses ``MixedPrecision``'s ``GradScaler``: torch's scaler refuses fp16
gradients, so O2 first moves the model's fp16 gradients into the masters' fp32 ``.grad``.
Where the backend casts the weights as it gathers them (fsdp), they stay fp32 and are the
masters; the precision then casts only buffers, inputs and outputs, and scales the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mpt.errors import UsageError
from mpt.precision.amp_config import AmpConfig
from mpt.precision.base import PrecisionSpec
from mpt.precision.forward import cast_floats
from mpt.precision.mixed import LossScaleConfig, MixedPrecision


def _refuse_vanishing_eps(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose ``eps`` rounds to 0 in its low-precision parameters' dtype.

    Without fp32 masters (O3) Adam's update divides by ``sqrt(v) + eps`` in fp16: with the
    default eps of 1e-8, which is 0 in fp16, a parameter whose gradient is 0 divides 0 by 0 and
    the model is NaN from the second step, silently.
    """
    for group in optimizer.param_groups:
        eps = group.get("eps")
        dtypes = {p.dtype for p in group["params"] if p.is_floating_point()}
        for dtype in dtypes - {torch.float32, torch.float64}:
            if isinstance(eps, float) and eps > 0 and torch.tensor(eps, dtype=dtype).item() == 0:
                smallest = torch.finfo(dtype).tiny
                raise UsageError("optimizer eps", eps, f"it is 0 in the {dtype} parameters this "
                                 "opt level keeps without fp32 masters, so the update turns NaN",
                                 f"pass eps of at least {smallest:.1e} (1e-4 is usual for pure "
                                 f"{dtype}), or use O2, which steps fp32 masters")


class ApexPrecision(MixedPrecision):
    """One Apex opt level (``AmpConfig``) as an mpt precision, usable under every backend.

    The optimizer must hold the model's parameters when ``setup_optimizer`` runs: it replaces
    each cast one by its fp32 master, as Apex did, so checkpoints map masters back to the
    model's parameter names through ``model_parameter``.
    """

    def __init__(self, device_type: str, config: AmpConfig,
                 loss_scale: LossScaleConfig | None = None) -> None:
        scaling = config.loss_scale_config(loss_scale or LossScaleConfig())
        super().__init__(device_type, config.low_dtype, scaling)
        self.config = config
        self.name = config.name
        # GradScaler only where its fp32-gradient rule holds (fp32 weights or fp32 masters) and
        # there is something to scale; pure fp16 with a static scale unscales by hand below.
        fp32_grads = not config.casts_model or config.master_weights
        if not (fp32_grads and config.low_dtype == torch.float16 and (
                scaling.dynamic or scaling.init_scale != 1.0)):
            self.scaler = None
        self._static_scale = 1.0 if self.scaler is not None else scaling.init_scale
        self._fp32_source: dict[int, torch.Tensor] = {}
        """Weights before the cast, by id of the parameter: exact fp32 masters, not re-widened."""
        self._masters: list[tuple[nn.Parameter, nn.Parameter]] = []
        """(master, model parameter) pairs in optimizer order."""
        self._model_of: dict[int, nn.Parameter] = {}
        self._grads_moved: set[int] = set()
        self._backend_casts = False
        """The backend casts the weights as it gathers them and steps fp32 ones (its masters)."""

    @property
    def spec(self) -> PrecisionSpec:
        config = self.config
        params = config.cast_model_type if config.casts_model else torch.float32
        assert params is not None
        scaled = self.scaler is not None or self._static_scale != 1.0
        return PrecisionSpec(
            name=self.name, params=params, reduce=params,
            compute=config.low_dtype if config.patch_torch_functions else params,
            master=torch.float32 if config.master_weights or not config.casts_model else params,
            norm=torch.float32 if config.keep_batchnorm_fp32 or not config.casts_model
            else params,
            autocast=config.patch_torch_functions,
            loss_scaling=self._scaling_kind() if self.scaler is not None
            else "static" if scaled else "none")

    # -- the model ------------------------------------------------------------------------------
    def autocast(self) -> AbstractContextManager[Any]:
        if self.config.patch_torch_functions:
            return super().autocast()
        return contextlib.nullcontext()

    def leave_cast_to_backend(self) -> None:
        self._backend_casts = True

    def convert_module(self, module: nn.Module) -> nn.Module:
        config = self.config
        if not config.casts_model:
            return module
        dtype = config.cast_model_type
        assert dtype is not None
        for sub in module.modules():
            if config.keep_batchnorm_fp32 and isinstance(sub, _BatchNorm):
                continue  # batchnorm's statistics need fp32's range; torch mixes the dtypes
            for param in () if self._backend_casts else sub.parameters(recurse=False):
                if param.is_floating_point() and param.dtype != dtype:
                    if config.master_weights:
                        self._fp32_source[id(param)] = param.detach().float().clone()
                    param.data = param.data.to(dtype)
            for name, buf in sub.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(sub, name, buf.to(dtype))
        # As Apex's patched forward: floating inputs to the model's dtype, outputs to fp32.
        outputs = config.cast_model_outputs or torch.float32
        module.register_forward_pre_hook(
            lambda _m, args, kwargs: (cast_floats(args, dtype), cast_floats(kwargs, dtype)),
            with_kwargs=True)
        module.register_forward_hook(lambda _m, _args, out: cast_floats(out, outputs))
        return module

    def setup_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._backend_casts:  # the optimizer steps the backend's fp32 weights: its masters
            return
        if not self.config.master_weights:
            _refuse_vanishing_eps(optimizer)
            return
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                if param.dtype == torch.float32 or id(param) in self._model_of:
                    continue
                source = self._fp32_source.pop(id(param), None)
                # The weights the backend left in the model win (DDP broadcasts rank 0's): the
                # exact fp32 copy is used only when it still rounds to them.
                if source is None or not torch.equal(source.to(param.dtype), param.detach()):
                    source = param.detach().float()
                master = nn.Parameter(source.clone(), requires_grad=True)
                group["params"][i] = master
                self._masters.append((master, param))
                self._model_of[id(master)] = param

    def master_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The tensors the optimizer steps: fp32 masters where there are some."""
        for group in optimizer.param_groups:
            yield from group["params"]

    def model_parameter(self, param: nn.Parameter) -> nn.Parameter:
        return self._model_of.get(id(param), param)

    # -- the step -------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return loss if self._static_scale == 1.0 else loss * self._static_scale
        return super().scale_loss(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._grads_moved:
            return
        self._grads_moved.add(id(optimizer))
        self._move_grads_to_masters(optimizer)
        if self.scaler is not None:
            super().unscale_(optimizer)
        elif self._static_scale != 1.0:
            inverse = 1.0 / self._static_scale
            for param in self.master_params(optimizer):
                if param.grad is not None:
                    param.grad.mul_(inverse)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        self.unscale_(optimizer)
        try:
            stepped = super().optimizer_step(optimizer)
        finally:
            self._grads_moved.discard(id(optimizer))
        if stepped:
            self.masters_to_model(optimizer)
        return stepped

    def zero_model_grads(self) -> None:
        """Drop the model's own gradients where masters carry them (``zero_grad`` of compat)."""
        for _, param in self._masters:
            param.grad = None

    def _move_grads_to_masters(self, optimizer: torch.optim.Optimizer) -> None:
        for master in self.master_params(optimizer):
            param = self._model_of.get(id(master))
            if param is None:
                continue
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None  # the masters own this step's gradient now

    @torch.no_grad()
    def masters_to_model(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy the stepped fp32 masters into the model's low-precision weights."""
        for master in self.master_params(optimizer):
            param = self._model_of.get(id(master))
            if param is not None:
                param.copy_(master)

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Re-derive the masters from the model's weights (after loading only the model)."""
        for master, param in self._masters:
            master.copy_(param)

    # -- state ----------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self._static_scale if self.scaler is None else super().loss_scale

    def _named_masters(self, module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in ``module``'s state dict, fp32 master) of each cast weight with a master."""
        master_of = {id(param): master for master, param in self._masters}
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in master_of:
                yield name, master_of[id(param)]

    def weights_to_save(self, module: nn.Module,
                        state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        masters = {name: master.detach() for name, master in self._named_masters(module)
                   if name in state}
        return {**state, **masters}

    @torch.no_grad()
    def weights_loaded(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        for name, master in self._named_masters(module):
            if name in state:
                master.copy_(state[name])

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["opt_level"] = self.config.name
        return state  # the masters are the checkpoint's weights (weights_to_save)

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(dict(state))
        # Written before the masters were the checkpoint's weights: they came as a list.
        masters = state.get("master_params")
        if masters is not None and len(masters) == len(self._masters):
            for (master, param), saved in zip(self._masters, masters, strict=True):
                master.copy_(saved)
                param.copy_(saved)
