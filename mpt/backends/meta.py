"""Models built on the meta device (``with torch.device("meta"):``), given real weights one module
at a time, so that no rank ever holds the whole model.

Every rank initialises every module in module order (the order construction ran their
``reset_parameters``) from rank 0's CPU random state: the weights are those of the same model
built on the CPU after the same seed, on every rank. A backend keeps the modules it needs
(fsdp: each unit, until ``fully_shard`` keeps its shard; a pipeline: this rank's stage) and
returns the others to the meta device as soon as they have drawn their numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from mpt.backends.base import Backend, on_meta
from mpt.errors import UsageError


def check_materialisable(model: nn.Module) -> None:
    """Refuse, in one line, a meta model that module-by-module initialisation would get wrong:
    tied weights (they would come apart) or weights with no ``reset_parameters`` to draw them."""
    tied = len(list(model.named_parameters(remove_duplicate=False))) != len(
        list(model.named_parameters()))
    if tied:
        raise UsageError("model", type(model).__name__, "it ties weights between modules, "
                         "which materialising it on the meta device would untie",
                         "build it on the CPU")
    missing = [name or type(model).__name__ for name, module in model.named_modules()
               if on_meta(module, recurse=False) and not hasattr(module, "reset_parameters")]
    if missing:
        raise UsageError("model", ", ".join(missing[:3]), "these modules on the meta device "
                         "have weights or buffers but no reset_parameters() to initialise them",
                         "give them a reset_parameters(), or build the model on the CPU")


@contextlib.contextmanager
def rank0_random_state(backend: Backend) -> Iterator[None]:
    """Draw from rank 0's CPU random state on every rank (collective); the other ranks have
    their own back afterwards, rank 0 keeps the state the draws left, as a CPU build would."""
    own = torch.get_rng_state()
    torch.set_rng_state(backend.broadcast_object(own if backend.world.rank == 0 else None))
    try:
        yield
    finally:
        if backend.world.rank != 0:
            torch.set_rng_state(own)


def materialise(module: nn.Module, device: torch.device | str) -> None:
    """Give ``module``'s own meta tensors (not its children's) real values: allocated on the
    CPU, drawn by its ``reset_parameters``, then moved to ``device`` (new Parameter objects: an
    optimizer built over the meta ones must be pointed at these by name)."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        module.reset_parameters()  # type: ignore[operator]
    for name, param in list(module.named_parameters(recurse=False)):
        setattr(module, name, nn.Parameter(param.to(device), requires_grad=param.requires_grad))
    for name, buffer in list(module.named_buffers(recurse=False)):
        setattr(module, name, buffer.to(device))
