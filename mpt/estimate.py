"""Per-rank memory of a training job, estimated before it runs (`mpt estimate-memory`).

The model is built on the meta device (no weights allocated, no matter its size); the bytes of
parameters, gradients and optimizer state each backend keeps per rank come from the backend
itself (``Backend.estimate_memory``), activations from one forward on meta tensors that counts
what autograd saves for the backward. What is not counted: the framework's own buffers
(communication buckets, DeepSpeed's flat staging buffers), the allocator's slack and the
process's code, a few hundred MiB at least; docs/benchmarks.md compares the estimate with
measured runs.
"""

from __future__ import annotations

import importlib
import inspect
import runpy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mpt.errors import UsageError

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1, "rmsprop": 1,
                    "adagrad": 1}
"""fp32 values each optimizer keeps per parameter (Adam: two moments)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """What one rank holds for one choice of backend and options, in bytes."""

    label: str
    """The backend and the options the row assumes (``deepspeed --zero-stage 2``)."""
    parameters: int
    """Weights on the device, including a sharding backend's gathered unit."""
    gradients: int
    """Gradients on the device."""
    optimizer: int
    """Optimizer state on the device: its moments and any fp32 master weights."""
    host: int = 0
    """What offloading keeps in host memory instead."""

    @property
    def device(self) -> int:
        """Parameters, gradients and optimizer state on the device."""
        return self.parameters + self.gradients + self.optimizer


@dataclass(frozen=True, kw_only=True, slots=True)
class Buffers:
    """What one rank holds in a step beyond its ``MemoryEstimate`` row, in bytes
    (``Backend.estimate_buffers``): `mpt plan` counts it in the rank's peak."""

    held: int = 0
    """The backend's own buffers (DDP's buckets, fsdp's unit gathered ahead and the
    reduce-scatter input it keeps)."""
    released: int = 0
    """What of the row and ``held`` the backward frees before the optimizer steps (fsdp's
    gathered units), so that the step's temporaries may reuse it."""
    between: int = 0
    """Allocated after the backward and freed before the optimizer steps (mpt's own flat
    buckets under a pipeline or tensor parallelism, one at a time): beside neither the
    activations nor the step's temporaries."""
    stepping: int = 0
    """Allocated after the backward and kept through the optimizer's step (DeepSpeed's
    partition of the gradients flattened in fp32), where the optimizer steps: beside the
    step's temporaries, not the activations."""
    reserved: int = 0
    """Allocated whole but written only in part, beyond ``held`` (the part written): counted
    on a device with memory of its own, whose allocator hands out the whole block; not on a
    CPU rank, whose pages become resident only once written (Horovod's fusion buffer)."""


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """Parameters of ``model``, and those of them that train."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def load_model(spec: str) -> Callable[[], nn.Module]:
    """``FILE.py:FUNCTION`` or ``package.module:FUNCTION``: a function that builds the model."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UsageError("MODEL", spec, "it does not name a function",
                         "pass FILE.py:FUNCTION or package.module:FUNCTION")
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise FileNotFoundError(where)
            namespace = runpy.run_path(where, run_name="mpt_estimate")
        else:
            namespace = vars(importlib.import_module(where))
    except (ImportError, FileNotFoundError) as exc:
        raise UsageError("MODEL", spec, f"{where} cannot be loaded ({exc})",
                         "pass an existing file or an importable module") from None
    function = namespace.get(name)
    if not callable(function):
        raise UsageError("MODEL", spec, f"{where} has no function {name!r}",
                         f"name a function of {where} that returns the model")
    try:
        inspect.signature(function).bind()
    except TypeError as exc:  # what calling it without arguments would raise
        raise UsageError("MODEL", spec, f"{name} cannot be called without arguments ({exc})",
                         f"name a function that takes none, e.g. def build(): return "
                         f"{name}(...) in a file of your own") from None
    except ValueError:  # no signature to read (some builtins): calling it will tell
        pass
    return function


def meta_model(build: Callable[[], nn.Module]) -> nn.Module:
    """The model ``build`` returns, with every tensor on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = build()
    if not isinstance(model, nn.Module):
        raise UsageError("MODEL", type(model).__name__, "the function did not return an "
                         "nn.Module", "return the model (not a tuple) from the function")
    return model


def activation_bytes(model: nn.Module, example: torch.Tensor) -> int:
    """Bytes autograd saves for the backward in one forward of ``example`` (meta tensors)."""
    parameters = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # Weights, and views of them (a Linear saves its weight transposed), are counted as
        # parameters already; ``_base`` is the tensor a view was taken of (torch's view docs).
        base = tensor if tensor._base is None else tensor._base
        if id(base) not in parameters:
            saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(example)  # kept alive until the sum: ids of saved tensors stay unique
        total = sum(saved.values())
    del output
    return total


def example_input(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(tuple(shape), dtype=dtype, device="meta")


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotEstimate:
    """What ``--snapshot-every`` costs in memory, in bytes, under any backend: every rank keeps
    1/N of the state (its shards, its stage, or its share of replicated tensors)."""

    piece: int
    """One rank's piece of one snapshot: weights (and fp32 masters) and optimizer state / N."""
    store: int
    """A node's store: the newest ``KEEP`` snapshots' pieces of its own ranks and of the
    previous node's (their copy)."""
    adds: int
    """What taking a snapshot adds to a rank's resident memory: the two transfer buffers (and,
    from a GPU, a host copy of one tensor at a time, not counted)."""
    restore_adds: int
    """What a restore adds to a rank: the parts in flight, a window of at most ``CHUNK`` bytes
    (or one part larger than that, at most the largest tensor)."""


def snapshot_estimate(model: nn.Module, *, weight_bytes: int, master_bytes: int,
                      optimizer_states: int, world_size: int, per_node: int
                      ) -> SnapshotEstimate:
    """``SnapshotEstimate`` of ``model`` (on the meta device): ``weight_bytes`` per weight,
    ``master_bytes`` per trained weight for fp32 masters (0: none), ``optimizer_states`` fp32
    values per trained weight, over ``world_size`` ranks, ``per_node`` on a node."""
    from mpt.checkpoint.snapshot import CHUNK, KEEP

    weights, trained = parameter_counts(model)
    state = weights * weight_bytes + trained * (master_bytes + 4 * optimizer_states)
    piece = -(-state // world_size)
    copies = 2 if world_size > per_node else 1  # its own, and the previous node's
    largest = max((p.numel() * max(p.element_size(), 4) for p in model.parameters()),
                  default=0)
    return SnapshotEstimate(piece=piece, store=KEEP * copies * piece * per_node,
                            adds=2 * CHUNK, restore_adds=max(CHUNK, largest))
