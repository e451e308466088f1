"""Resident memory per rank of an fsdp job against its share of the training state, mpt or raw.

    .venv/bin/mpt launch --gpus 4 --backend fsdp benchmarks/state_memory.py --save
    .venv/bin/mpt launch --gpus 4 --backend fsdp --host-memory lean \
        benchmarks/state_memory.py --save
    .venv/bin/mpt launch --gpus 4 benchmarks/state_memory.py --save --raw
    MALLOC_MMAP_THRESHOLD_=131072 .venv/bin/mpt launch --gpus 4 \
        benchmarks/state_memory.py --save --raw            # raw, with what lean sets

A residual MLP of ``--blocks`` blocks (LayerNorm(width) -> Linear(width, 4 width) -> GELU ->
Linear(4 width, width), plus the input; 100.7 M parameters at the defaults) is built on the
meta device and trains with AdamW for ``--steps`` steps on batches of ``--batch`` x 16 tokens
(small: the state dominates, not the activations), then, with ``--save``, saves once.

- **mpt** (the default): ``mpt.Runtime``, ``rt.setup`` (each Linear a unit, then the root: the
  fsdp backend's default for this model), ``rt.backward``, ``rt.step``, ``rt.save`` into a temp
  dir. Run it under ``mpt launch --backend fsdp``.
- **raw** (``--raw``): torch alone in the processes ``mpt launch`` (or torchrun) starts:
  ``init_process_group("gloo")``, ``fully_shard`` on each Linear and on the root of the meta
  model, ``to_empty`` and ``reset_parameters``, ``torch.optim.AdamW``, ``backward``, ``step``,
  ``zero_grad``, and ``torch.distributed.checkpoint.save`` of ``get_state_dict``.

A thread samples the process's resident set size (RSS) every 5 ms. Per rank, against the rank's
share of the fp32 state (16 bytes per parameter: weights, gradients and AdamW's two moments,
over the ``dp_shard`` ranks that split them) and the bound of 1.15 x share + 256 MiB: the RSS
before the setup (after the Runtime, or the process group), the peak RSS above it over the run
and per phase, what stays resident after training, and the mean step time after the first
step. Read mpt/raw from the two runs' lines; the step time on a loaded machine is noisy.

A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from sharded_memory import RssSampler
from torch import nn

MiB = 2**20
TOKENS = 16
"""Tokens per sample: activations stay small beside the state."""
ALLOWANCE, SLACK = 1.15, 256 * MiB
"""The bound on the peak RSS above the RSS before the setup: ALLOWANCE x share + SLACK."""


class Block(nn.Module):
    """x + Linear(GELU(Linear(LayerNorm(x)))): a transformer's MLP half."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def make_model(blocks: int, width: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[Block(width) for _ in range(blocks)])


class Phases:
    """Peak RSS above the RSS before the setup, and seconds, per phase."""

    def __init__(self, sampler: RssSampler, barrier: Callable[[], None]) -> None:
        self.sampler, self.barrier = sampler, barrier
        self.before_setup = sampler.now()
        sampler.highest = self.before_setup
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def run(self, name: str, work: Callable[[], Any]) -> Any:
        self.barrier()
        self.sampler.reset()
        began = time.perf_counter()
        result = work()
        self.barrier()
        self.seconds[name] = time.perf_counter() - began
        self.peaks[name] = self.sampler.peak - self.before_setup
        return result


def train(steps: int, step: Callable[[torch.Tensor], None], batch: int, width: int
          ) -> list[tuple[float, float]]:
    """``steps`` steps on random batches; each one's wall and CPU seconds (this process's
    threads: a figure less at the mercy of other jobs on the machine than the wall time)."""
    times = []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        step(torch.randn(batch, TOKENS, width))
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def report(rank: int, head: str, params: int, shards: int, start: int, phases: Phases,
           trained: int, step_times: list[tuple[float, float]]) -> str:
    share = 16 * params / shards
    bound = ALLOWANCE * share + SLACK
    peak = phases.sampler.highest - phases.before_setup
    timed = step_times[1:] or step_times
    rows = [f"rank {rank}: {head}; {params / 1e6:.1f} M parameters over {shards} shards: share "
            f"{share / MiB:.0f} MiB, bound {ALLOWANCE} x share + {SLACK // MiB} MiB = "
            f"{bound / MiB:.0f} MiB; RSS at start {start / MiB:.0f} MiB, before setup "
            f"{phases.before_setup / MiB:.0f} MiB"]
    for name, added in phases.peaks.items():
        rows.append(f"  {name:5s} peak +{added / MiB:6.0f} MiB = {added / share:5.2f} x share "
                    f"= {added / bound:5.2f} x bound  in {phases.seconds[name]:6.2f} s")
    rows.append(f"  run   peak +{peak / MiB:6.0f} MiB = {peak / share:5.2f} x share = "
                f"{peak / bound:5.2f} x bound (goal <= 1), "
                f"+{(phases.sampler.highest - start) / MiB:.0f} MiB above the start; resident "
                f"after training +{(trained - phases.before_setup) / MiB:.0f} MiB; step "
                f"{sum(w for w, _ in timed) / len(timed):.2f} s, CPU "
                f"{sum(c for _, c in timed) / len(timed):.2f} s (means of {len(timed)} after "
                "the first)")
    return "\n".join(rows)


def run_mpt(args: argparse.Namespace, sampler: RssSampler, start: int) -> None:
    import mpt

    rt = mpt.Runtime(quiet=True)
    model = make_model(args.blocks, args.width)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    phases = Phases(sampler, rt.barrier)
    model, optimizer = phases.run("setup", lambda: rt.setup(model, optimizer))

    def step(x: torch.Tensor) -> None:
        rt.backward(model(x).square().mean())
        rt.step()

    times = phases.run("train", lambda: train(args.steps, step, args.batch, args.width))
    trained = sampler.now()
    if args.save:
        root = rt.backend.broadcast_object(tempfile.mkdtemp(prefix="mpt-state-mem-")
                                           if rt.rank == 0 else None)
        phases.run("save", lambda: rt.save(root, step=args.steps))
        if rt.rank == 0:
            shutil.rmtree(root)
    sampler.close()
    head = (f"mpt {rt.backend.name}, {rt.world_size} ranks ({rt.topology.plan.describe()}), "
            f"--host-memory {rt.config.host_memory}")
    lines = report(rt.rank, head, params, rt.topology.plan.dp_shard, start, phases, trained,
                   times)
    for rank in range(rt.world_size):
        rt.barrier()
        if rank == rt.rank:
            print(lines, flush=True)
    rt.close()


def run_raw(args: argparse.Namespace, sampler: RssSampler, start: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_* from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))  # before the baseline, as the Runtime's group
    # The first fully_shard imports torch._dynamo and more (~110 MiB of code), which importing
    # mpt and making the Runtime did before its baseline: pay it here too, on a module of 1.
    fully_shard(nn.Linear(1, 1, bias=False), mesh=mesh)
    model = make_model(args.blocks, args.width)
    params = sum(p.numel() for p in model.parameters())
    phases = Phases(sampler, dist.barrier)

    def setup() -> torch.optim.Optimizer:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        return torch.optim.AdamW(model.parameters(), lr=1e-4)

    optimizer = phases.run("setup", setup)

    def step(x: torch.Tensor) -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    times = phases.run("train", lambda: train(args.steps, step, args.batch, args.width))
    trained = sampler.now()
    if args.save:
        made = [tempfile.mkdtemp(prefix="raw-state-mem-") if rank == 0 else None]
        dist.broadcast_object_list(made)
        root = made[0]
        assert root is not None

        def save() -> None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=root)

        phases.run("save", save)
        if rank == 0:
            shutil.rmtree(root)
    sampler.close()
    malloc = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    head = (f"raw fully_shard, {world} ranks, "
            f"{'MALLOC_MMAP_THRESHOLD_=' + malloc if malloc else 'glibc defaults'}")
    lines = report(rank, head, params, world, start, phases, trained, times)
    for r in range(world):
        dist.barrier()
        if r == rank:
            print(lines, flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help=f"samples of {TOKENS} tokens")
    parser.add_argument("--save", action="store_true", help="save once after training")
    parser.add_argument("--raw", action="store_true",
                        help="torch alone: fully_shard by hand, no mpt.Runtime")
    args = parser.parse_args()
    # Torch's notes on what this model does not do (in-place ops on a unit's output) or does
    # not need (the same random numbers as a single process would draw) would drown the figures.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    warnings.filterwarnings("ignore", message="DTensor random operators")
    sampler = RssSampler()
    start = sampler.now()
    (run_raw if args.raw else run_mpt)(args, sampler, start)


if __name__ == "__main__":
    main()
