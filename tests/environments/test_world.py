"""World: the rank maths and the validation every detector and flag parser relies on."""

from __future__ import annotations

import dataclasses

import pytest

from mpt.environments import World
from mpt.errors import UsageError


def test_rank_maths_two_nodes() -> None:
    world = World(nodes=2, gpus=4, nr=1, local_rank=2)
    assert (world.rank, world.world_size, world.is_distributed) == (6, 8, True)


def test_default_is_one_local_process() -> None:
    world = World()
    assert (world.rank, world.world_size, world.is_distributed) == (0, 1, False)
    assert (world.master_addr, world.master_port, world.source) == ("127.0.0.1", 29500, "local")


def test_all_processes_in_rank_order() -> None:
    processes = list(World(nodes=2, gpus=2).all_processes())
    assert processes == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        World().nr = 1  # type: ignore[misc]


@pytest.mark.parametrize(("fields", "argument"), [
    ({"nodes": 0}, "--nodes"),
    ({"nodes": "2"}, "--nodes"),
    ({"gpus": 0}, "--gpus"),
    ({"gpus": -1}, "--gpus"),
    ({"nodes": 2, "nr": 2}, "--nr"),
    ({"nr": -1}, "--nr"),
    ({"gpus": 2, "local_rank": 2}, "local_rank"),
    ({"master_port": 0}, "--master-port"),
    ({"master_port": 65536}, "--master-port"),
    ({"master_port": "29500"}, "--master-port"),
])
def test_invalid_world_names_the_argument(fields: dict[str, object], argument: str) -> None:
    with pytest.raises(UsageError) as caught:
        World(**fields)  # type: ignore[arg-type]
    assert caught.value.argument == argument
    assert str(caught.value).startswith(f"{argument}=")
