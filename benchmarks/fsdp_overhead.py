"""Step time of mpt's ``fsdp`` backend against a hand-written ``fully_shard`` loop, in one run.

    .venv/bin/mpt launch --gpus 2 --backend fsdp benchmarks/fsdp_overhead.py
    .venv/bin/mpt launch --gpus 2 --backend fsdp --precision bf16-mixed \
        benchmarks/fsdp_overhead.py

Both sides shard the same MLP the same way (each Linear a unit, then the root: what
``--fsdp-wrap Linear`` asks mpt for), start from the same weights, see the same batches and
train with the same AdamW and clip, in the same processes and on the process group mpt opened:

- **mpt**: ``rt.setup`` then ``rt.autocast/backward/clip_grad_norm_/step``;
- **raw**: ``fully_shard`` by hand, an optimizer built over the sharded parameters, then
  ``zero_grad``, forward (under ``torch.autocast`` for bf16/fp16), ``backward`` (through a
  ``torch.amp.GradScaler`` for fp16), ``clip_grad_norm_`` and ``step``.

Timing follows ``ab_rounds.py`` (alternating rounds, slowest rank's step, medians); the ratio
is mpt/raw (goal <= 1.02). After the run both sides' full weights must agree bit for bit.
A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from ab_rounds import compare, describe
from ddp_overhead import GOAL, RAW_LOOPS, make_batches, make_model, mpt_step_fn, raw_step_fn
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import mpt
from mpt.environments.host_memory import apply_host_memory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per side first")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of A/B segments")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--hidden", type=int, default=None,
                        help="MLP width (default 1024; 256 for fp16-mixed on CPU)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    apply_host_memory("steady")  # glibc keeps what a step frees (--host-memory steady)
    torch.manual_seed(0)  # same initial weights on every rank and on both sides
    rt = mpt.Runtime(backend="fsdp", backend_options={"wrap": "Linear"}, quiet=True)
    if rt.world_size < 2:
        raise SystemExit("run this through `mpt launch --gpus 2 --backend fsdp`")
    precision, device_type = rt.precision.name, rt.device.type
    if precision not in RAW_LOOPS:
        raise SystemExit(f"no hand-written loop for precision {precision}; use one of {RAW_LOOPS}")
    hidden = args.hidden or (256 if precision == "fp16-mixed" and device_type == "cpu" else 1024)
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    base = make_model(hidden)
    raw_model = copy.deepcopy(base).to(rt.device)
    loss_fn, clip = nn.CrossEntropyLoss(), 1.0
    batches = make_batches(rt.rank, args.batch_size, rt.device)

    mesh = init_device_mesh(device_type, (rt.world_size,))
    for module in raw_model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(raw_model, mesh=mesh)
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)
    mpt_model, mpt_opt = rt.setup(base, torch.optim.AdamW(base.parameters(), lr=1e-3))

    rt.print(f"fsdp overhead: {rt.world_size} processes, {dist.get_backend()} on {device_type}, "
             f"precision {precision}, torch {torch.__version__}, {torch.get_num_threads()} "
             f"thread(s)/process (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    rt.print(f"model: MLP 512-{hidden}-{hidden}-10, {sum(p.numel() for p in base.parameters()):,}"
             f" parameters, each Linear an FSDP unit, batch {args.batch_size}/process, AdamW, "
             f"clip {clip}")
    result = compare(
        mpt_step_fn(rt, mpt_model, batches, loss_fn, clip),
        raw_step_fn(raw_model, raw_opt, precision, device_type,
                    getattr(rt.precision, "scaling", None), batches, loss_fn, clip),
        (mpt_opt, raw_opt), warmup=args.warmup, rounds=args.rounds, steps=args.steps,
        sync=sync)
    full = StateDictOptions(full_state_dict=True)
    mine, raw = get_model_state_dict(mpt_model, options=full), get_model_state_dict(
        raw_model, options=full)
    diff = max(float((mine[k] - raw[k]).abs().max()) for k in raw)
    rt.print(describe(result))
    rt.print(f"check: max |w_mpt - w_raw| = {diff:.3g}{'' if diff == 0 else '  (NOT identical)'}")
    rt.print(f"fsdp {precision}: mpt {result.a_ms:.2f} ms, raw {result.b_ms:.2f} ms, ratio "
             f"{result.ratio:.3f} (goal <= {GOAL})")
    rt.close()


if __name__ == "__main__":
    main()
