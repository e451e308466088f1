"""The loader's resumable position, simulated in one process with one loader per rank."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mpt.data import DistributedLoader, ResumableSampler

CPU = torch.device("cpu")


@pytest.mark.parametrize(("size", "world", "shuffle", "drop_last"),
                         list(itertools.product([10, 11], [1, 3], [True, False], [True, False])))
def test_without_a_resume_it_deals_what_distributed_sampler_deals(size, world, shuffle,
                                                                  drop_last):
    data = list(range(size))
    for rank in range(world):
        ours = ResumableSampler(data, rank=rank, world_size=world, shuffle=shuffle, seed=5,
                                drop_last=drop_last)
        torch_s = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle,
                                     seed=5, drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            torch_s.set_epoch(epoch)
            assert list(ours) == list(torch_s) and len(ours) == len(torch_s)


def loaders(world: int, batch: int, size: int = 48) -> list[DistributedLoader]:
    data = TensorDataset(torch.arange(size))
    return [DistributedLoader(DataLoader(data, batch_size=batch, shuffle=True), rank=r,
                              world_size=world, device=CPU, seed=1) for r in range(world)]


def take(group: list[DistributedLoader], batches: int) -> list[int]:
    """``batches`` steps of every rank, leaving the iterators where a training loop would."""
    iters = [iter(loader) for loader in group]
    return [i for _ in range(batches) for it in iters for i in next(it)[0].tolist()]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4), (4, 3)])
def test_a_resume_at_another_world_size_sees_the_rest_of_the_epoch_once(before, after):
    first = loaders(before, 8 // before)
    seen = take(first, 2)  # 16 of 48 samples of epoch 0
    state = first[0].state_dict()
    assert state == {"epoch": 0, "seen": 16} and all(lo.state_dict() == state for lo in first)
    second = loaders(after, 24 // after)
    for loader in second:
        loader.load_state_dict(state)
    rest = [i for loader in second for batch in loader for i in batch[0].tolist()]
    assert set(seen + rest) == set(range(48))  # none skipped ...
    # ... and none repeated, except DistributedSampler's padding of an epoch's last batch when
    # the rest (32) does not divide among the ranks
    assert len(seen + rest) == 48 + (-32) % after
    assert all(lo.state_dict() == {"epoch": 1, "seen": 0} for lo in second)
    # the next epoch is the one an uninterrupted run would have had
    whole = loaders(1, 24)
    list(whole[0])  # epoch 0
    assert sorted(take(second, 1)) == sorted(next(iter(whole[0]))[0].tolist())


def test_positions_add_up_over_two_resumes():
    first = loaders(2, 4)
    take(first, 1)
    second = loaders(1, 8)
    second[0].load_state_dict(first[0].state_dict())
    take(second, 2)
    assert second[0].state_dict() == {"epoch": 0, "seen": 24}
