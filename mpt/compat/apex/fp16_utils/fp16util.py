"""``apex.fp16_utils.fp16util``: the helpers of manual fp16 training (before amp).

A half-precision model trains on fp32 "master" copies of its parameters: gradients are copied to
the masters, the optimizer steps the masters, and the masters are copied back into the model.
``flat_master=True`` keeps all masters in one flat tensor, as Apex did.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mpt.errors import UsageError


class tofp16(nn.Module):
    """A module that casts its input to fp16 (the first layer of ``network_to_half``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half()


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Put every batch-norm layer of ``module`` back into fp32 (their statistics need it)."""
    for child in module.modules():
        if isinstance(child, _BatchNorm) and child.affine:
            child.float()
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``network`` in fp16 but its batch norms, behind a layer that casts inputs to fp16."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating parameters and buffers (not its children's) to ``dtype``."""
    for param in module.parameters(recurse=False):
        if param is not None and param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad.data = param.grad.data.to(dtype)
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is not None and buffer.is_floating_point():
            setattr(module, name, buffer.to(dtype))


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every layer of ``network`` to ``dtype`` except affine batch norms (kept fp32)."""
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
    return network


class FP16Model(nn.Module):
    """``network`` converted to fp16 (batch norms fp32); inputs are cast to fp16 on the way in."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.network(*(t.half() for t in inputs))


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def prep_param_lists(model: nn.Module, flat_master: bool = False
                     ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The model's trainable parameters and fp32 master copies of them (one flat one with
    ``flat_master``), which require grad: hand the masters to the optimizer."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        master = nn.Parameter(_flatten(model_params))
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    masters = [nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(model_params: list[nn.Parameter],
                                master_params: list[nn.Parameter],
                                flat_master: bool = False) -> None:
    """Copy the model's gradients into the masters' (as fp32; missing ones as None)."""
    if flat_master:
        master_params[0].grad = _flatten([p.grad if p.grad is not None
                                          else torch.zeros_like(p) for p in model_params])
        return
    for model, master in zip(model_params, master_params, strict=True):
        master.grad = None if model.grad is None else model.grad.detach().float().clone()


def master_params_to_model_params(model_params: list[nn.Parameter],
                                  master_params: list[nn.Parameter],
                                  flat_master: bool = False) -> None:
    """Copy the masters' values back into the model's parameters (in the model's dtype)."""
    if flat_master:
        sizes = [p.numel() for p in model_params]
        pieces = torch.split(master_params[0].detach(), sizes)
        masters: Iterable[torch.Tensor] = (m.view_as(p) for m, p in zip(pieces, model_params,
                                                                         strict=True))
    else:
        masters = (m.detach() for m in master_params)
    with torch.no_grad():
        for model, master in zip(model_params, masters, strict=True):
            model.copy_(master)


def to_python_float(t: torch.Tensor | float) -> float:
    """A one-element tensor (or a number) as a Python float."""
    if isinstance(t, torch.Tensor):
        if t.numel() != 1:
            raise UsageError("to_python_float", f"a tensor of {t.numel()} elements", "it needs "
                             "one element", "reduce the tensor first (e.g. .mean())")
        return float(t.item())
    return float(t)


clip_grad_norm = torch.nn.utils.clip_grad_norm_
"""Apex's alias of torch's gradient clipping."""
