"""mpt's deepspeed backend against a hand-written DeepSpeed loop, per ZeRO stage, in one run.

Run it through `mpt launch` (it needs a process group of at least two ranks)::

    mpt launch --gpus 2 --backend deepspeed benchmarks/deepspeed_overhead.py [--stages 0,1,2,3]

For each stage both sides get the same initial weights, the same batches and the same DeepSpeed
config (the one mpt built), and train with AdamW:

- **mpt**: ``mpt.Runtime(backend="deepspeed")``: ``rt.autocast()``, ``rt.backward``, ``rt.step``;
- **raw**: ``deepspeed.initialize`` + ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``.

Timed segments alternate between the sides (which goes first alternates every round); a step's
time is the slowest rank's. It prints the median step time per side and their ratio (goal <=
1.02), checks that both sides ended on identical weights (same arithmetic), and measures memory:

- optimizer-state bytes on rank 0 (Adam's two moments plus DeepSpeed's fp32 master copy, which
  it keeps at stages 1-3 even in fp32) against the ZeRO formula K * params / ranks with K = 12
  (no division at stage 0, and K = 8 there in fp32, where the torch optimizer steps the weights
  themselves);
- the process's resident set size (RSS) once the stage's two engines have trained.

A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import psutil  # installed with deepspeed
import torch
import torch.distributed as dist
from torch import nn

import mpt

GOAL = 1.02
StepFn = Callable[[int], None]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="0,1,2,3", help="ZeRO stages, comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per side first")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of A/B segments")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width")
    return parser.parse_args()


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def make_batches(rank: int, size: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(size, 512, generator=gen).to(device),
             torch.randint(0, 10, (size,), generator=gen).to(device)) for _ in range(8)]


def optimizer_state_bytes(engine: Any) -> int:
    """Bytes of optimizer state held by this rank: moments, plus fp32 masters where separate."""
    inner = engine.optimizer if engine.optimizer is engine.basic_optimizer \
        else engine.optimizer.optimizer
    total = sum(v.numel() * v.element_size() for state in inner.state.values()
                for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    opt = engine.optimizer
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3's fp32 master shards
        masters = list(opt.fp32_partitioned_groups_flat)
    elif opt is not engine.basic_optimizer:  # ZeRO 1-2, bf16: the inner optimizer's params
        masters = [p for g in inner.param_groups for p in g["params"]]
    else:
        masters = []
    return total + sum(p.numel() * p.element_size() for p in masters)


def full_weights(engine: Any) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p)
        out.append((p.detach() if full is None else full).float().cpu())
    return out


def max_over_ranks(times: list[float]) -> torch.Tensor:
    t = torch.tensor(times, dtype=torch.float64) * 1e3
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return t


def run_stage(stage: int, args: argparse.Namespace) -> dict[str, float]:
    import deepspeed

    torch.manual_seed(0)
    rt = mpt.Runtime(backend="deepspeed", backend_options={"zero_stage": stage})
    base = make_model(args.hidden)
    twin = copy.deepcopy(base)
    n_params = sum(p.numel() for p in base.parameters())
    loss_fn = nn.CrossEntropyLoss()
    batches = make_batches(rt.rank, args.batch_size, rt.device)

    model, _ = rt.setup(base, torch.optim.AdamW(base.parameters(), lr=1e-3))
    raw, _, _, _ = deepspeed.initialize(model=twin.to(rt.device),
                                        optimizer=torch.optim.AdamW(twin.parameters(), lr=1e-3),
                                        config=rt.backend.config, dist_init_required=False)

    def mpt_step(i: int) -> None:
        x, y = batches[i % len(batches)]
        with rt.autocast():
            loss = loss_fn(model(x), y)
        rt.backward(loss)
        rt.step()

    def raw_step(i: int) -> None:
        x, y = batches[i % len(batches)]
        with rt.autocast():  # the same autocast a hand-written loop needs in bf16
            loss = loss_fn(raw(x), y)
        raw.backward(loss)
        raw.step()

    sides: dict[str, StepFn] = {"mpt": mpt_step, "raw": raw_step}
    for step in sides.values():
        for i in range(args.warmup):
            step(i)
    cursor = dict.fromkeys(sides, args.warmup)
    times: dict[str, list[torch.Tensor]] = {"mpt": [], "raw": []}
    for r in range(args.rounds):
        for name in (("mpt", "raw") if r % 2 == 0 else ("raw", "mpt")):
            gc.collect()
            dist.barrier()
            segment = []
            for i in range(cursor[name], cursor[name] + args.steps):
                t0 = time.perf_counter()
                sides[name](i)
                segment.append(time.perf_counter() - t0)
            cursor[name] += args.steps
            times[name].append(max_over_ranks(segment))

    mpt_t, raw_t = torch.cat(times["mpt"]), torch.cat(times["raw"])
    mpt_ms, raw_ms = float(mpt_t.median()), float(raw_t.median())
    diff = max(float((a - b).abs().max())
               for a, b in zip(full_weights(model), full_weights(raw), strict=True))
    state = optimizer_state_bytes(model)
    # fp32 at stage 0: the torch optimizer steps the weights themselves (no master copy)
    k = 8 if stage == 0 and rt.precision.name == "fp32" else 12
    formula = k * n_params / (1 if stage == 0 else rt.world_size)
    rss = psutil.Process().memory_info().rss
    rt.print(f"zero{stage} {rt.precision.name}: mpt {mpt_ms:.2f} ms, raw {raw_ms:.2f} ms, ratio "
             f"{mpt_ms / raw_ms:.3f} (goal <= {GOAL}); max |w_mpt - w_raw| = {diff:.3g}; "
             f"optimizer state {state / 2**20:.2f} MiB/rank vs formula "
             f"{formula / 2**20:.2f} MiB, ratio {state / formula:.3f}; RSS {rss / 2**20:.0f} MiB")
    return {"ratio": mpt_ms / raw_ms}


def main() -> None:
    args = parse_args()
    probe = mpt.Runtime(backend="deepspeed")  # opens the process group for every stage
    if not dist.is_initialized() or probe.world_size < 2:
        raise SystemExit("run this through `mpt launch --gpus 2`: it needs a process group")
    probe.print(f"deepspeed overhead: {probe.world_size} processes, {dist.get_backend()} on "
                f"{probe.device.type}, torch {torch.__version__}, precision "
                f"{probe.precision.name}, OMP_NUM_THREADS="
                f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; MLP 512-{args.hidden}-"
                f"{args.hidden}-10, batch {args.batch_size}/process, AdamW; {args.warmup} warm-up "
                f"steps, {args.rounds} rounds x {args.steps} steps per side")
    for stage in (int(s) for s in args.stages.split(",")):
        run_stage(stage, args)
        gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    probe.print(f"peak RSS of rank 0 over the whole run: {peak:.0f} MiB")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
