"""What setup_dataloader does with each kind of sampler, simulated in one process, one loader per
rank, against what the script's own loader yields under torch (no mpt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    Sampler,
    TensorDataset,
    WeightedRandomSampler,
)

import mpt
from mpt.checkpoint.format import MANIFEST, STATE_JSON, entry_for
from mpt.data import DistributedLoader

CPU = torch.device("cpu")
DATA = TensorDataset(torch.arange(22))


def rows(batches) -> list[int]:
    return [i for batch in batches for i in batch[0].tolist()]


def user_loaders(**sampler_args) -> list[DataLoader]:
    """What a Horovod or torchrun script builds: a DistributedSampler per rank."""
    return [DataLoader(DATA, batch_size=3, sampler=DistributedSampler(
        DATA, num_replicas=2, rank=r, **sampler_args)) for r in range(2)]


def wrap(loaders: list[DataLoader], **kwargs) -> list[DistributedLoader]:
    return [DistributedLoader(lo, rank=r, world_size=2, device=CPU, **kwargs)
            for r, lo in enumerate(loaders)]


@pytest.mark.parametrize("args", [{}, {"shuffle": False}, {"seed": 7, "drop_last": True}])
def test_a_distributed_sampler_keeps_its_order_and_the_scripts_set_epoch(args):
    want, given = user_loaders(**args), user_loaders(**args)
    got = wrap(given)
    for epoch in (1, 2, 5):  # Horovod's MNIST counts epochs from 1
        for theirs, mine, ours in zip(want, given, got, strict=True):
            theirs.sampler.set_epoch(epoch)
            mine.sampler.set_epoch(epoch)  # on the script's own object, as scripts do
            assert rows(ours) == rows(theirs), (epoch, args)
            assert ours.epoch == epoch + 1
    # the shuffled default is not rows 0, 2, 4, ... (the reported bug)
    if args == {}:
        assert rows(wrap(user_loaders())[0]) != list(range(0, 22, 2))


def test_without_set_epoch_each_pass_is_the_next_epoch():
    got = wrap(user_loaders(seed=3))
    want = user_loaders(seed=3)
    for epoch in range(3):
        for theirs in want:
            theirs.sampler.set_epoch(epoch)
        assert [rows(lo) for lo in got] == [rows(lo) for lo in want]


def test_a_distributed_sampler_resumes_mid_epoch_with_the_scripts_set_epoch():
    first = user_loaders(seed=4)
    ours = wrap(first)
    for lo in first:
        lo.sampler.set_epoch(3)
    iters = [iter(lo) for lo in ours]
    seen = [rows([next(it), next(it)]) for it in iters]  # two batches of each rank
    state = ours[0].state_dict()
    assert state == {"epoch": 3, "seen": 12} and ours[1].state_dict() == state
    again = user_loaders(seed=4)
    resumed = wrap(again)
    for lo, loader in zip(resumed, again, strict=True):
        lo.load_state_dict(state)
        loader.sampler.set_epoch(3)  # the script's loop sets the epoch it resumes in
    rest = [rows(lo) for lo in resumed]
    whole = user_loaders(seed=4)
    for lo in whole:
        lo.sampler.set_epoch(3)
    assert sorted(seen[0] + rest[0] + seen[1] + rest[1]) == sorted(
        rows(whole[0]) + rows(whole[1]))


class EpochOrder(Sampler[int]):
    """A custom sampler: every rank sees every row, in an order chosen by the epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(
            self.epoch)).tolist())


@pytest.mark.parametrize("kind", ["sampler", "batch_sampler"])
def test_other_samplers_are_kept_and_resume_by_skipping_batches(kind):
    def make() -> DataLoader:
        if kind == "sampler":
            return DataLoader(DATA, batch_size=4, sampler=EpochOrder(22))
        return DataLoader(DATA, batch_sampler=BatchSampler(EpochOrder(22), 4, False))

    loader = DistributedLoader(make(), rank=0, world_size=2, device=CPU)
    assert loader.keeps_sampler
    reference = make()
    for epoch in range(2):
        (reference.sampler if kind == "sampler" else reference.batch_sampler.sampler
         ).set_epoch(epoch)
        assert rows(loader) == rows(reference)  # kept: the whole order, on every rank
    it = iter(loader)
    head = rows([next(it), next(it)])
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches": 2}
    resumed = DistributedLoader(make(), rank=0, world_size=2, device=CPU)
    resumed.load_state_dict(state)
    assert len(resumed) == 4  # 6 batches, 2 done
    whole = make()
    (whole.sampler if kind == "sampler" else whole.batch_sampler.sampler).set_epoch(2)
    assert head + rows(resumed) == rows(whole)


def test_a_sampler_drawing_with_replacement_is_kept():
    sampler = WeightedRandomSampler([1.0] * 22, 10)
    loader = DistributedLoader(DataLoader(DATA, batch_size=5, sampler=sampler), rank=1,
                               world_size=2, device=CPU)
    assert loader.keeps_sampler and len(rows(loader)) == 10


def test_positions_are_saved_by_name_and_old_list_checkpoints_still_load(tmp_path):
    def runtime() -> mpt.Runtime:
        rt = mpt.Runtime(env={})
        model = torch.nn.Linear(1, 1)
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return rt

    rt = runtime()
    train = rt.setup_dataloader(DataLoader(DATA, batch_size=2, shuffle=True))
    test = rt.setup_dataloader(DataLoader(DATA, batch_size=5), name="test")
    assert (train.name, test.name) == ("train", "test")
    it = iter(train)
    next(it), next(it), next(it)
    list(test)
    where = rt.save(tmp_path / "ck", step=1)
    state = json.loads((Path(where) / STATE_JSON).read_text())
    assert state["loaders"] == {"train": {"epoch": 0, "seen": 6},
                                "test": {"epoch": 1, "seen": 0}}

    # set up in the other order: each gets its own position back
    rt2 = runtime()
    test2 = rt2.setup_dataloader(DataLoader(DATA, batch_size=5), name="test")
    train2 = rt2.setup_dataloader(DataLoader(DATA, batch_size=2, shuffle=True), name="train")
    rt2.load(where)
    assert train2.state_dict() == {"epoch": 0, "seen": 6} and test2.epoch == 1

    # a checkpoint from before names: a list, in set-up order
    folder = Path(where)
    state["loaders"] = [{"epoch": 0, "seen": 8}, {"epoch": 4, "seen": 0}]
    data = json.dumps(state).encode()
    (folder / STATE_JSON).write_bytes(data)
    manifest = json.loads((folder / MANIFEST).read_text())
    entry = entry_for(data)
    manifest["files"][STATE_JSON] = {"sha256": entry.sha256, "bytes": entry.bytes}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    rt3 = runtime()
    train3 = rt3.setup_dataloader(DataLoader(DATA, batch_size=2, shuffle=True))
    test3 = rt3.setup_dataloader(DataLoader(DATA, batch_size=5))
    rt3.load(folder)
    assert train3.state_dict() == {"epoch": 0, "seen": 8} and test3.epoch == 4
    for r in (rt, rt2, rt3):
        r.close()



@pytest.mark.parametrize("kind", ["distributed", "kept"])
def test_a_pass_draws_from_the_global_generator_as_the_scripts_loader_does_but_a_resumed_one(
        kind):
    """A DataLoader draws its workers' base seed from torch's global generator once per pass:
    the step's draws after it (dropout, noise) are the same under mpt as without it, and a
    pass resumed mid-epoch does not draw again (the checkpoint's RNG state holds that draw)."""
    def make() -> DataLoader:
        return (user_loaders()[0] if kind == "distributed"
                else DataLoader(DATA, batch_size=4, sampler=EpochOrder(22)))

    def draws_after_passes(loader, passes: int = 2) -> list[torch.Tensor]:
        return [torch.rand(3) for _ in range(passes) for _ in [rows(loader)]]

    torch.manual_seed(5)
    want = draws_after_passes(make())
    torch.manual_seed(5)
    assert all(map(torch.equal, draws_after_passes(wrap([make()])[0]), want))

    torch.manual_seed(5)
    ours = wrap([make()])[0]
    batches = iter(ours)
    next(batches), next(batches)  # a checkpoint here: mid-epoch, the pass's draw made
    position, rng = ours.state_dict(), torch.get_rng_state()
    uninterrupted = [torch.rand(3) for _ in [list(batches)]] + draws_after_passes(ours, 1)
    resumed = wrap([make()])[0]
    resumed.load_state_dict(position)
    torch.set_rng_state(rng)
    assert all(map(torch.equal, draws_after_passes(resumed), uninterrupted))
