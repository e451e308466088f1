"""Per-rank data loading: each process sees its own shard, reshuffled every epoch, resumable.

The position saved in a checkpoint is ``(epoch, seen)``: the epoch and how many positions of that
epoch's global order the whole job has consumed. The global order depends only on the seed and
the epoch, and ranks take its positions interleaved (rank r: positions r, r + W, r + 2W, ...), so
after k batches of B rows on W ranks exactly the first ``k * B * W`` positions are consumed. A
resumed run drops those positions and deals the rest out to however many ranks it has: nothing
is repeated or skipped, at the same world size or another one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler

from mpt.errors import UsageError


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


class ResumableSampler(Sampler[int]):
    """``DistributedSampler``'s shard of an epoch's order, after the first ``offset`` positions.

    With ``offset == 0`` it yields exactly what ``torch.utils.data.DistributedSampler`` yields
    (same permutation, same padding or dropping of the tail), so runs that never resume behave as
    before.
    """

    def __init__(self, dataset: Sized, *, rank: int, world_size: int, shuffle: bool,
                 seed: int = 0, drop_last: bool = False) -> None:
        self.size = len(dataset)
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0
        """Positions of this epoch's global order already consumed (before a resume)."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        """This epoch's global order of the dataset's indices."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # what DistributedSampler seeds with
        return torch.randperm(self.size, generator=g).tolist()

    @property
    def remaining(self) -> int:
        """Positions of the global order this pass still has to deal out."""
        return max(self.size - self.offset, 0)

    def __len__(self) -> int:
        n, w = self.remaining, self.world_size
        if self.drop_last and n % w:
            return math.ceil((n - w) / w)
        return math.ceil(n / w)

    def __iter__(self) -> Iterator[int]:
        indices = self.order()[self.offset:]
        total = len(self) * self.world_size
        if not indices:
            return iter(())
        if total > len(indices):  # pad by repeating from the front, as DistributedSampler does
            repeats = math.ceil((total - len(indices)) / len(indices))
            indices += (indices * repeats)[:total - len(indices)]
        return iter(indices[:total][self.rank:total:self.world_size])


class DistributedLoader:
    """A DataLoader over this rank's shard that calls ``set_epoch`` by itself and can resume.

    Forgetting ``sampler.set_epoch(epoch)`` is the classic DDP bug (every epoch sees the same
    order); here each full pass over the loader advances the epoch. ``batch_size`` stays the
    per-rank batch: the global batch is ``batch_size * world_size``. A batch counts as seen once
    the loader has handed it out, so a checkpoint saved inside the loop body resumes after it.
    """

    def __init__(self, loader: DataLoader[Any], *, rank: int, world_size: int,
                 device: torch.device, seed: int = 0) -> None:
        if loader.batch_size is None:
            raise UsageError("DataLoader", "batch_sampler=...", "mpt shards by sample and needs "
                             "a fixed batch size", "pass batch_size=... instead of a batch sampler")
        self.sampler = ResumableSampler(
            loader.dataset, rank=rank, world_size=world_size,  # type: ignore[arg-type]
            shuffle=isinstance(loader.sampler, RandomSampler), seed=seed,
            drop_last=loader.drop_last)
        self.loader = DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=self.sampler,
            num_workers=loader.num_workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, drop_last=loader.drop_last,
            worker_init_fn=loader.worker_init_fn, generator=loader.generator,
            persistent_workers=loader.persistent_workers,
        )
        self.batch_size: int = loader.batch_size
        self.world_size = world_size
        self.device = device
        self.epoch = 0
        """The epoch the next pass will use for shuffling."""
        self._batches = 0  # handed out in the current pass
        self._in_pass = False

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffle of the next pass explicitly (e.g. after resuming)."""
        self.epoch = epoch

    def __len__(self) -> int:
        self.sampler.set_epoch(self.epoch)
        return len(self.loader)

    @property
    def seen(self) -> int:
        """Positions of the current epoch's global order the whole job has consumed."""
        if not self._in_pass:
            return self.sampler.offset
        rows = min(self._batches * self.batch_size, len(self.sampler))
        return self.sampler.offset + min(rows * self.world_size, self.sampler.remaining)

    def state_dict(self) -> dict[str, int]:
        """The position to resume from: ``{"epoch": e, "seen": positions consumed in e}``."""
        return {"epoch": self.epoch, "seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state``'s position; the next pass continues epoch ``state["epoch"]``."""
        self.epoch = int(state["epoch"])
        self.sampler.offset = int(state["seen"])
        self._in_pass = False

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self._batches, self._in_pass = 0, True
        for batch in self.loader:
            self._batches += 1
            yield move_to_device(batch, self.device)
        self.epoch += 1
        self.sampler.offset, self._batches, self._in_pass = 0, 0, False
