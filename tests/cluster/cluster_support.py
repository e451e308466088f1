"""What the multi-node tests share: the skip when no emulated cluster can be built here, node i's
`mpt launch` line for the test worker, and the reference a job must match."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mpt.cluster import ClusterRun, EmulatedCluster, launch_command, run_nodes, unavailable_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from common import global_batches, make_model, make_optimizer

WORKER = Path(__file__).parent / "train_worker.py"
MICRO = 4
"""Rows per rank per step, as train_worker.py takes them."""

REASON = unavailable_reason()
needs_cluster = pytest.mark.skipif(REASON is not None, reason=REASON or "")
"""Skips a test that builds an emulated cluster where none can be built, saying why."""


def run_job(cluster: EmulatedCluster, out: Path, steps: int, *, gpus: int, port: int,
            launch_args: tuple[str, ...] = (), stop: int | None = None,
            timeout: float = 240, master_addr: str | None = None) -> ClusterRun:
    """train_worker.py on every node of ``cluster``, each node its own `mpt launch --nr i`,
    meeting at ``master_addr`` (None: node 0's address)."""
    args = [str(out), str(steps), *([str(stop)] if stop is not None else [])]
    commands = [launch_command(cluster, nr, WORKER, args, gpus=gpus, master_port=port,
                               master_addr=master_addr, launch_args=launch_args)
                for nr in range(cluster.nodes)]
    return run_nodes(cluster, commands, timeout=timeout, env={"OMP_NUM_THREADS": "1"})


def read_ranks(out: Path, world_size: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def reference(world_size: int, steps: int) -> list[dict]:
    """What rank r of a one-node job of ``world_size`` processes reports, from one process of
    plain torch: its loss on its slice of each global batch, and the weights the mean gradient
    of the whole batch reaches."""
    model = make_model()
    optimizer = make_optimizer(model)
    losses: list[dict[str, float]] = [{} for _ in range(world_size)]
    for step, (x, y) in enumerate(global_batches(steps, world_size * MICRO)):
        for rank in range(world_size):
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            with torch.no_grad():
                losses[rank][str(step)] = nn.functional.mse_loss(model(x[rows]), y[rows]).item()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    params = {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}
    return [{"losses": losses[rank], "params": params} for rank in range(world_size)]


def assert_same_training(got: list[dict], want: list[dict], rtol: float = 1e-5) -> None:
    """Every rank's losses and final weights agree with ``want``'s, to ``rtol``."""
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["losses"].keys() == w["losses"].keys(), rank
        torch.testing.assert_close(torch.tensor(list(g["losses"].values())),
                                   torch.tensor(list(w["losses"].values())), rtol=rtol, atol=0)
        assert g["params"].keys() == w["params"].keys(), rank
        for name in g["params"]:
            torch.testing.assert_close(torch.tensor(g["params"][name]),
                                       torch.tensor(w["params"][name]), rtol=rtol, atol=1e-7,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
