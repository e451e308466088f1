"""Step time with ``--grad-compression`` against the same backend uncompressed, in one run.

    .venv/bin/mpt launch --gpus 2 benchmarks/grad_compression.py                  # ddp, bf16
    .venv/bin/mpt launch --gpus 2 --backend apex benchmarks/grad_compression.py --compression fp16
    .venv/bin/mpt launch --gpus 2 benchmarks/grad_compression.py --compression powersgd

Both sides are the launch's backend (``--backend``, its options and ``--bucket-mb``), built
twice on the process group ``mpt.Runtime`` opened: one with ``--compression``, one without.
They train the same communication-bound job (an MLP of ``--layers`` square layers of
``--hidden``, fp32, ``--batch-size`` samples per process: few FLOPs per gradient byte, the shape
of issue 23's 25 M-parameter MLP at batch 8) from the same weights on the same batches, in
alternating rounds (``ab_rounds.compare``): the figure is the median step time (the slowest
rank's) compressed / uncompressed. PowerSGD starts at the first step DDP allows (2) unless
``--backend-options`` says otherwise.

On one host the gradients cross shared memory (loopback), where bytes are cheap and casting
them is not: what compression saves across a network is mostly not there to save. This is a
benchmark: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
from ab_rounds import compare, describe  # benchmarks/ is the script's folder
from torch import nn

import mpt
from mpt.backends import Backend
from mpt.backends.ddp import CAST_DTYPES
from mpt.comm import COMPRESSIONS, GradComm
from mpt.environments.host_memory import apply_host_memory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="bf16", choices=COMPRESSIONS[1:])
    parser.add_argument("--hidden", type=int, default=2048, help="width of each layer")
    parser.add_argument("--layers", type=int, default=3, help="square layers")
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per side first")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of A/B segments")
    return parser.parse_args()


def allreduce_ms(numel: int, dtype: torch.dtype, device: torch.device) -> float:
    """Median time of ``dist.all_reduce`` of ``numel`` values of ``dtype`` (the slowest rank)."""
    tensor = torch.ones(numel, dtype=dtype, device=device)
    times = []
    for _ in range(5):
        dist.barrier()
        began = time.perf_counter()
        dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    slowest = torch.tensor(sorted(times)[2] * 1e3)
    dist.all_reduce(slowest, dist.ReduceOp.MAX)
    return float(slowest)


def main() -> None:
    args = parse_args()
    malloc = "steady" if apply_host_memory("steady") is None else "default"
    rt = mpt.Runtime(quiet=True)
    if not dist.is_initialized() or rt.world_size < 2:
        raise SystemExit("run this through `mpt launch --gpus 2`: it needs a process group")
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.Tanh())
                           for _ in range(args.layers)]).to(rt.device)
    numel = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(rt.rank)
    batches = [(torch.randn(args.batch_size, args.hidden, generator=g).to(rt.device),
                torch.randn(args.batch_size, args.hidden, generator=g).to(rt.device))
               for _ in range(8)]
    sync = torch.cuda.synchronize if rt.device.type == "cuda" else (lambda: None)
    options = dict(rt.config.backend_options)
    if args.compression == "powersgd":
        options.setdefault("powersgd_start_step", 2)

    def side(compression: str) -> tuple:
        backend: Backend = type(rt.backend)(
            world=rt.world, device=rt.device, precision=rt.precision, timeout=rt.backend.timeout,
            options=options, comm=GradComm(compression=compression,
                                           bucket_mb=rt.config.bucket_mb))
        backend.init_process_group()  # joins the group the runtime opened (Horovod: hvd.init)
        model = copy.deepcopy(base)  # the same initial weights on both sides
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        model, optimizer = backend.setup(model, optimizer)

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            backend.backward(nn.functional.mse_loss(model(x), y), model)
            backend.optimizer_step(model, optimizer)
            backend.zero_grad(optimizer)

        return step, optimizer

    compressed, opt_c = side(args.compression)
    plain, opt_p = side("none")
    result = compare(compressed, plain, (opt_c, opt_p), warmup=args.warmup, rounds=args.rounds,
                     steps=args.steps, sync=sync)
    rt.print(f"{rt.world_size} processes, backend {rt.backend.name}, {dist.get_backend()} on "
             f"{rt.device.type}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)/"
             f"process (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), malloc "
             f"{malloc}; MLP {args.layers} x {args.hidden}: {numel / 1e6:.1f} M parameters, "
             f"{4 * numel / 2**20:.0f} MiB of fp32 gradients per step, batch {args.batch_size}")
    rt.print(f"step time --grad-compression {args.compression} / none: {result.ratio:.3f}")
    rt.print(describe(result, args.compression, "none"))
    if args.compression in CAST_DTYPES:  # where the time goes: the bytes, or their arithmetic
        wire = {dtype: allreduce_ms(numel, dtype, rt.device)
                for dtype in (torch.float32, CAST_DTYPES[args.compression])}
        rt.print("one allreduce of the gradients alone (median of 5): " + ", ".join(
            f"{str(dtype).removeprefix('torch.')} {ms:.1f} ms" for dtype, ms in wire.items()))
    rt.close()


if __name__ == "__main__":
    main()
