"""Per-rank data loading: each process sees its own shard, reshuffled every epoch, resumable.

What ``rt.setup_dataloader`` does with a loader depends on the sampler the script gave it:

- a plain one (``shuffle=True`` or ``False``: torch's ``RandomSampler``/``SequentialSampler``)
  is replaced by mpt's ``ResumableSampler``, which shards it like ``DistributedSampler``;
- a ``torch.utils.data.DistributedSampler`` is dealt by a ``ResumableSampler`` with its own
  ``num_replicas``, ``rank``, ``shuffle``, ``seed`` and ``drop_last``, which yields exactly the
  indices it yields; ``sampler.set_epoch(e)`` on the script's object still picks the epoch;
- any other sampler or batch sampler is kept as the script built it (it decides what each rank
  sees); its position is the number of batches handed out, and a resume skips that many.

The position saved by the first two is ``(epoch, seen)``: the epoch and how many positions of that
epoch's global order the whole job has consumed. The global order depends only on the seed and
the epoch, and ranks take its positions interleaved (rank r: positions r, r + W, r + 2W, ...), so
after k batches of B rows on W ranks exactly the first ``k * B * W`` positions are consumed. A
resumed run drops those positions and deals the rest out to however many ranks it has: nothing
is repeated or skipped, at the same world size or another one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from mpt.errors import UsageError
from mpt.scaling import BatchPlan


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


class SkippingBatches(Sampler[list[int]]):
    """A kept batch sampler that leaves out its first ``skip`` batches (after a resume)."""

    def __init__(self, batches: Iterable[list[int]]) -> None:
        self.batches = batches
        self.skip = 0

    def __len__(self) -> int:
        return max(len(self.batches) - self.skip, 0)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batches), self.skip, None)


def resumable_sampler(loader: DataLoader[Any], *, rank: int, world_size: int,
                      seed: int) -> ResumableSampler | None:
    """The sampler mpt deals this rank's shard with, or None when the loader's own is kept."""
    dataset = loader.dataset
    if loader.batch_size is None or isinstance(dataset, IterableDataset):
        return None  # a batch sampler or a stream: the script's own sharding
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        shuffle = False
    elif type(sampler) is RandomSampler:
        if sampler.replacement or sampler.num_samples != len(dataset):  # type: ignore[arg-type]
            return None  # draws with replacement, or not one epoch: not a permutation to deal
        shuffle = True
    elif type(sampler) is DistributedSampler:
        return ResumableSampler(dataset, rank=sampler.rank,  # type: ignore[arg-type]
                                world_size=sampler.num_replicas, shuffle=sampler.shuffle,
                                seed=sampler.seed, drop_last=sampler.drop_last)
    else:
        return None
    return ResumableSampler(dataset, rank=rank, world_size=world_size,  # type: ignore[arg-type]
                            shuffle=shuffle, seed=seed, drop_last=loader.drop_last)


def _epoch_owner(loader: DataLoader[Any]) -> Any:
    """The script's sampler whose ``set_epoch`` chooses the shuffle, if it has one."""
    batches = loader.batch_sampler
    for candidate in (loader.sampler, batches, getattr(batches, "sampler", None)):
        if callable(getattr(candidate, "set_epoch", None)):
            return candidate
    return None


def _rebuilt(loader: DataLoader[Any], **how: Any) -> DataLoader[Any]:
    """``loader``'s dataset and settings with another sampler (``how``)."""
    workers = {"prefetch_factor": loader.prefetch_factor,
               "persistent_workers": loader.persistent_workers} if loader.num_workers else {}
    return DataLoader(loader.dataset, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context,
                      generator=loader.generator, **workers, **how)


class DistributedLoader:
    """A DataLoader over this rank's shard that calls ``set_epoch`` by itself and can resume.

    Forgetting ``sampler.set_epoch(epoch)`` is the classic DDP bug (every epoch sees the same
    order); here each full pass over the loader advances the epoch, unless the script sets it on
    its own sampler (``DistributedSampler.set_epoch``), which then wins. ``batch_size`` stays the
    per-rank batch. A batch counts as seen once the loader has handed it out, so a checkpoint
    saved inside the loop body resumes after it. ``name`` keys the position in checkpoints.
    """

    def __init__(self, loader: DataLoader[Any], *, rank: int, world_size: int,
                 device: torch.device, seed: int = 0, name: str = "train") -> None:
        self.name = name
        self.sampler = resumable_sampler(loader, rank=rank, world_size=world_size, seed=seed)
        self._owner = _epoch_owner(loader)
        self._synced = getattr(self._owner, "epoch", None)  # the owner's epoch mpt last saw
        self._skipping: SkippingBatches | None = None
        if self.sampler is not None:
            self.loader = _rebuilt(loader, batch_size=loader.batch_size, sampler=self.sampler,
                                   drop_last=loader.drop_last)
        elif isinstance(loader.dataset, IterableDataset):
            self.loader = loader  # a stream: a resume consumes the batches it skips
        else:
            self._skipping = SkippingBatches(loader.batch_sampler)  # type: ignore[arg-type]
            self.loader = _rebuilt(loader, batch_sampler=self._skipping)
        # A DataLoader draws its workers' base seed from its generator when each pass starts:
        # without one of its own, from torch's global generator, a draw that a resume mid-epoch
        # would not replay. So it gets a generator of its own, and the global draw is made
        # where a resume replays it (see __iter__).
        self._generator: torch.Generator | None = None
        if self.loader.generator is None:
            self._generator = self.loader.generator = torch.Generator()
        self._rank = rank if self.sampler is None else self.sampler.rank
        self._seed = seed
        self.batch_size: int | None = loader.batch_size
        self.world_size = world_size if self.sampler is None else self.sampler.world_size
        self.device = device
        self.epoch = 0
        """The epoch the next pass will use for shuffling."""
        self._skip = 0  # batches of a resumed epoch to leave out (kept samplers)
        self._batches = 0  # handed out in the current pass
        self._in_pass = False

    @property
    def keeps_sampler(self) -> bool:
        """True when the script's own sampler decides what this rank sees."""
        return self.sampler is None

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffle of the next pass explicitly (e.g. after resuming)."""
        self.epoch = epoch

    def _sync_epoch(self) -> None:
        """Take the epoch the script set on its own sampler since the last pass, then tell the
        sampler the epoch of this pass (a kept sampler shuffles by it)."""
        if self._owner is None:
            return
        theirs = getattr(self._owner, "epoch", None)
        if theirs is not None and theirs != self._synced and theirs != self.epoch:
            self.epoch = theirs  # another epoch than a resume restored: start it from its start
            self._skip = 0
            if self.sampler is not None:
                self.sampler.offset = 0
        self._owner.set_epoch(self.epoch)
        self._synced = self.epoch

    def __len__(self) -> int:
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        if self._skipping is not None:
            self._skipping.skip = self._skip
        return len(self.loader) - (self._skip if self._skipping is None else 0)

    @property
    def seen(self) -> int:
        """Positions of the current epoch's global order the whole job has consumed."""
        if self.sampler is None:
            return 0
        if not self._in_pass:
            return self.sampler.offset
        rows = min(self._batches * (self.batch_size or 0), len(self.sampler))
        return self.sampler.offset + min(rows * self.world_size, self.sampler.remaining)

    def state_dict(self) -> dict[str, int]:
        """The position to resume from: ``{"epoch": e, "seen": positions consumed in e}``, or
        ``{"epoch": e, "batches": batches handed out in e}`` for a kept sampler."""
        if self.sampler is None:
            return {"epoch": self.epoch, "batches": self._skip + self._batches
                    if self._in_pass else self._skip}
        return {"epoch": self.epoch, "seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state``'s position; the next pass continues epoch ``state["epoch"]``."""
        self.epoch = int(state["epoch"])
        rows = (self.batch_size or 0) * self.world_size  # what one batch of every rank consumes
        if self.sampler is None:
            self._skip = int(state["batches"]) if "batches" in state else (
                int(state.get("seen", 0)) // rows if rows else 0)
        else:
            self.sampler.offset = int(state["seen"]) if "seen" in state else (
                int(state.get("batches", 0)) * rows)
        if self._owner is not None:
            self._owner.set_epoch(self.epoch)
            self._synced = self.epoch
        self._in_pass = False

    def __iter__(self) -> Iterator[Any]:
        self._sync_epoch()
        if self._generator is not None:  # what a pass draws follows from the saved epoch
            self._generator.manual_seed(hash((self._seed, self.epoch, self._rank)) & (2**63 - 1))
            if not (self._skip or (self.sampler is not None and self.sampler.offset)):
                # The one draw the DataLoader made from the global generator when a pass began
                # (its workers' base seed), made here instead: the step's own draws (dropout, a
                # GAN's noise) stay those of the script without mpt. A pass resumed mid-epoch
                # made it before the checkpoint, whose RNG state holds it.
                torch.empty((), dtype=torch.int64).random_()
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        batches: Iterator[Any] = iter(self.loader)
        if self._skipping is not None:
            self._skipping.skip = self._skip
        elif self.sampler is None and self._skip:
            batches = itertools.islice(batches, self._skip, None)  # a stream: read and drop
        self._batches, self._in_pass = 0, True
        for batch in batches:
            self._batches += 1
            yield move_to_device(batch, self.device)
        self.epoch += 1
        self._skip = self._batches = 0
        self._in_pass = False
        if self.sampler is not None:
            self.sampler.offset = 0


class Loaders:
    """The loaders a run set up, by name: the first is the training loader (``"train"``),
    whose batch size is bound to the run's global batch; the others evaluate."""

    def __init__(self, *, rank: int, world_size: int, device: torch.device, seed: int,
                 batch_plan: BatchPlan | None) -> None:
        self.rank, self.world_size = rank, world_size
        """This rank's place among the ranks that split the data (the data-parallel ones)."""
        self.device = device
        self.seed = seed
        self.batch_plan = batch_plan
        self.loaders: list[DistributedLoader] = []

    def add(self, loader: DataLoader[Any], name: str | None) -> DistributedLoader:
        """``rt.setup_dataloader``: ``loader`` over this rank's shard, replacing any loader set up
        under the same name."""
        taken = {known.name for known in self.loaders}
        if name is None:  # the first is the training loader, the others are numbered
            name, number = "train", len(self.loaders)
            while name in taken:
                name, number = f"loader{number}", number + 1
        if name == "train" and self.batch_plan is not None and (
                loader.batch_size != self.batch_plan.batch_size):
            # The seeds' confusion: a per-rank batch that silently changes the global one.
            raise UsageError("DataLoader batch_size", loader.batch_size, "the "
                             f"{self.batch_plan.describe()} needs {self.batch_plan.batch_size} "
                             "per rank for the training loader", "build the DataLoader with "
                             "batch_size=rt.batch_size, or set up an evaluation loader with "
                             "another name (name=\"eval\")")
        distributed = DistributedLoader(loader, rank=self.rank, world_size=self.world_size,
                                        device=self.device, seed=self.seed, name=name)
        self.loaders = [*(known for known in self.loaders if known.name != name), distributed]
        return distributed
