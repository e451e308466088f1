"""Tokens/s and MFU of a GPT step through mpt against the same step in plain torch.

    .venv/bin/mpt launch --gpus 2 benchmarks/gpt_throughput.py
    .venv/bin/mpt launch --gpus 2 --precision bf16-mixed benchmarks/gpt_throughput.py
    .venv/bin/mpt launch --gpus 2 --precision bf16-mixed benchmarks/gpt_throughput.py --null
    .venv/bin/mpt launch --gpus 8 --precision bf16-mixed benchmarks/gpt_throughput.py \\
        --layers 12 --heads 12 --embed 768 --block 1024 --batch-size 8   # GPT-2 small, GPUs

The model of ``examples/gpt.py`` (imported from it) on random tokens, AdamW, clipping at 1.0.
Protocol as in ``ab_rounds.py``; tokens/s = per-rank batch x context x processes / median step
time; MFU = tokens/s x model FLOPs per token / (peak x processes), with the example's FLOPs
estimate (6 N + 12 L d T) and peak (``--peak-tflops``, a GPU datasheet, or a measured matmul
peak on CPUs). The ratio is mpt/raw step time (goal <= 1.02). A benchmark: it never fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from ab_rounds import compare, describe, max_weight_difference
from torch import nn
from torch.nn import functional as F
from workload_common import add_protocol_args, sides, start

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, flops_per_token, peak_flops  # the example's model

GOAL = 1.02
VOCAB = 65  # about a character corpus's


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per process")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="one device's peak (default: datasheet or measured)")
    add_protocol_args(parser, steps=5, warmup=5, rounds=10)
    return parser.parse_args()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def main() -> None:
    args = parse_args()
    rt, _, sync = start(args)
    gen = torch.Generator().manual_seed(1000 + rt.rank)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, VOCAB, (args.batch_size, args.block + 1), generator=gen)
        batches.append((tokens[:, :-1].to(rt.device), tokens[:, 1:].to(rt.device)))
    base = GPT(GPTConfig(vocab=VOCAB, block=args.block, layers=args.layers, heads=args.heads,
                         embed=args.embed))
    fpt = flops_per_token(base)
    n_params = sum(p.numel() for p in base.parameters())

    def adamw(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(module.parameters(), lr=1e-3, betas=(0.9, 0.95))

    a, b, optimizers, a_module, raw_module = sides(rt, base, adamw, batches, lm_loss, args.null)
    peak, source = peak_flops(rt, args.peak_tflops)
    rt.print(f"model: GPT {args.layers} layers x {args.embed}, {args.heads} heads, context "
             f"{args.block}, {n_params / 1e6:.2f} M parameters, {fpt / 1e6:.2f} MFLOP/token; "
             f"batch {args.batch_size}/process; peak {peak / 1e12:.3g} TFLOP/s per device "
             f"({source}); {args.warmup} warm-up steps, then {args.rounds} rounds x "
             f"{args.steps} steps per side")
    result = compare(a, b, optimizers, warmup=args.warmup, rounds=args.rounds, steps=args.steps,
                     sync=sync)
    tokens = args.batch_size * args.block * rt.world_size
    name = "raw2" if args.null else "mpt"
    rt.print(describe(result, name))
    rt.print(f"check: max |w_{name} - w_raw| = {max_weight_difference(a_module, raw_module):.3g}")
    rates = {side: tokens / ms * 1e3 for side, ms in ((name, result.a_ms), ("raw", result.b_ms))}
    mfu = {side: rate * fpt / (peak * rt.world_size) for side, rate in rates.items()}
    rt.print(f"gpt {rt.precision.name}{' (null)' if args.null else ''}: {name} "
             f"{rates[name]:,.0f} tokens/s (MFU {mfu[name]:.2%}), raw {rates['raw']:,.0f} "
             f"tokens/s (MFU {mfu['raw']:.2%}), step-time ratio {result.ratio:.3f} "
             f"(goal <= {GOAL})")
    rt.close()


if __name__ == "__main__":
    main()
