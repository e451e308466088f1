"""``apex.multi_tensor_apply``: ``multi_tensor_applier(op, noop_flag, tensor_lists, *args)``.

Apex launched one CUDA kernel over many tensors at once; the ops came from its ``amp_C``
extension. Where that extension imports, Apex's own applier is used. Otherwise the applier calls
``op`` with the same arguments, and this module offers the ``amp_C`` ops scripts use most, on
plain tensors with Apex's signatures: ``multi_tensor_scale``, ``multi_tensor_axpby`` and
``multi_tensor_l2norm`` (an overflow sets ``noop_flag`` to 1, as in Apex).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

Lists = Sequence[Sequence[torch.Tensor]]


def _finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Lists,
                       scale: float) -> None:
    """``out = in * scale`` for lists ``[inputs, outputs]``; a non-finite input sets the flag."""
    sources, targets = tensor_lists
    if not _finite(sources):
        noop_flag.fill_(1)
    with torch.no_grad():
        for source, target in zip(sources, targets, strict=True):
            target.copy_(source.float() * scale)


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Lists,
                       a: float, b: float, arg_to_check: int) -> None:
    """``out = a * x + b * y`` for lists ``[x, y, out]``; checks x (0), y (1) or both (-1)."""
    xs, ys, outs = tensor_lists
    checked = {0: list(xs), 1: list(ys), -1: [*xs, *ys]}[arg_to_check]
    if not _finite(checked):
        noop_flag.fill_(1)
    with torch.no_grad():
        for x, y, out in zip(xs, ys, outs, strict=True):
            out.copy_(a * x.float() + b * y.float())


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Lists,
                        per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all tensors of ``[tensors]`` together (a 1-element fp32 tensor), and the
    norm of each when ``per_tensor`` (else an empty tensor)."""
    (tensors,) = tensor_lists
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    if not bool(torch.isfinite(norms).all()):
        noop_flag.fill_(1)
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, norms if per_tensor else torch.empty(0, device=total.device)


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag, tensor_lists, *args)``, as Apex's applier did."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Always available here (Apex raised without its CUDA extension)."""

    def __call__(self, op: Callable[..., Any], noop_flag_buffer: torch.Tensor,
                 tensor_lists: Lists, *args: Any) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


def _real_applier() -> Any:
    """NVIDIA Apex's applier, where Apex and its ``amp_C`` kernels import."""
    try:
        importlib.import_module("amp_C")
        return importlib.import_module("apex.multi_tensor_apply").multi_tensor_applier
    except (ImportError, AttributeError, RuntimeError):
        return None


multi_tensor_applier: Any = _real_applier() or MultiTensorApply(2048 * 32)
"""The applier scripts import; Apex's chunk size."""

__all__ = ["MultiTensorApply", "multi_tensor_applier", "multi_tensor_axpby",
           "multi_tensor_l2norm", "multi_tensor_scale"]
