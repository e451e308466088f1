"""Per-rank data loading: each process sees its own shard, reshuffled every epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler


def move_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor inside (tuples, lists, dicts) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


class DistributedLoader:
    """A DataLoader over this rank's shard that calls ``set_epoch`` by itself.

    Forgetting ``sampler.set_epoch(epoch)`` is the classic DDP bug (every epoch sees the same
    order); here each full pass over the loader advances the epoch. ``batch_size`` stays the
    per-rank batch: the global batch is ``batch_size * world_size``.
    """

    def __init__(self, loader: DataLoader[Any], *, rank: int, world_size: int,
                 device: torch.device, seed: int = 0) -> None:
        shuffle = isinstance(loader.sampler, RandomSampler)
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
            drop_last=loader.drop_last)
        self.loader = DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=self.sampler,
            num_workers=loader.num_workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, drop_last=loader.drop_last,
            worker_init_fn=loader.worker_init_fn, generator=loader.generator,
            persistent_workers=loader.persistent_workers,
        )
        self.device = device
        self.epoch = 0
        """The epoch the next pass will use for shuffling."""

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffle of the next pass explicitly (e.g. after resuming)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        for batch in self.loader:
            yield move_to_device(batch, self.device)
        self.epoch += 1
