"""Images/s of a torchvision ResNet step through mpt against the same step in plain torch.

    .venv/bin/mpt launch --gpus 2 benchmarks/imagenet_throughput.py
    .venv/bin/mpt launch --gpus 2 --precision bf16-mixed benchmarks/imagenet_throughput.py
    .venv/bin/mpt launch --gpus 2 benchmarks/imagenet_throughput.py --null   # noise floor
    .venv/bin/mpt launch --gpus 8 --precision bf16-mixed benchmarks/imagenet_throughput.py \\
        --arch resnet50 --image-size 224 --batch-size 64                  # a GPU node

The workload of ``examples/imagenet.py`` (channels_last input, here also channels_last
weights, SGD with Nesterov momentum, clipping) on random images, so no data loading is timed:
what differs between the two sides is only what mpt adds to a step. Protocol (rounds of A/B
segments, the slower rank's step time, medians) as in ``ab_rounds.py``; images/s = per-rank
batch x processes / median step time. The ratio is mpt/raw step time (goal <= 1.02). Defaults
fit a 2-core CPU (resnet18 at 64 px, batch 16); on GPUs pass the ImageNet sizes. A benchmark:
it prints, it never fails.
"""

from __future__ import annotations

import argparse

import torch
from ab_rounds import compare, describe, max_weight_difference
from torch import nn
from workload_common import add_protocol_args, sides, start

GOAL = 1.02


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18", help="a torchvision.models classifier")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--classes", type=int, default=8)
    add_protocol_args(parser, steps=5, warmup=5, rounds=8)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torchvision  # here, as in the example: mpt never imports it

    rt, _, sync = start(args)
    gen = torch.Generator().manual_seed(1000 + rt.rank)  # different batches per rank
    batches = [(torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
                .to(rt.device, memory_format=torch.channels_last),
                torch.randint(0, args.classes, (args.batch_size,), generator=gen).to(rt.device))
               for _ in range(4)]
    base = torchvision.models.get_model(args.arch, weights=None, num_classes=args.classes)
    base = base.to(memory_format=torch.channels_last)
    n_params = sum(p.numel() for p in base.parameters())

    def sgd(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9, nesterov=True)

    a, b, optimizers, a_module, raw_module = sides(rt, base, sgd, batches, nn.CrossEntropyLoss(),
                                                   args.null)
    rt.print(f"model: {args.arch}, {n_params:,} parameters, {args.image_size} px, "
             f"batch {args.batch_size}/process, channels_last, SGD; {args.warmup} warm-up "
             f"steps, then {args.rounds} rounds x {args.steps} steps per side")
    result = compare(a, b, optimizers, warmup=args.warmup, rounds=args.rounds, steps=args.steps,
                     sync=sync)
    images = args.batch_size * rt.world_size
    name = "raw2" if args.null else "mpt"
    rt.print(describe(result, name))
    rt.print(f"check: max |w_{name} - w_raw| = {max_weight_difference(a_module, raw_module):.3g}")
    rt.print(f"imagenet {args.arch} {rt.precision.name}{' (null)' if args.null else ''}: "
             f"{name} {images / result.a_ms * 1e3:,.1f} images/s, raw "
             f"{images / result.b_ms * 1e3:,.1f} images/s, step-time ratio {result.ratio:.3f} "
             f"(goal <= {GOAL})")
    rt.close()


if __name__ == "__main__":
    main()
