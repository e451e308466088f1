"""What the ResNet and GPT benchmarks share: flags, the process group check, the two sides.

Both run under `mpt launch --gpus N [--precision P]`: side "mpt" goes through ``rt.setup`` and
``rt.autocast/backward/clip_grad_norm_/step`` (``ddp_overhead.mpt_step_fn``), side "raw" is
the loop a user writes with DistributedDataParallel, ``torch.autocast`` and, for fp16, a
``GradScaler`` (``ddp_overhead.raw_step_fn``), on the process group the runtime opened.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from ab_rounds import StepFn
from ddp_overhead import RAW_LOOPS, mpt_step_fn, raw_step_fn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mpt
from mpt.environments.host_memory import apply_host_memory

CLIP = 1.0
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def add_protocol_args(parser: argparse.ArgumentParser, *, steps: int, warmup: int,
                      rounds: int) -> None:
    parser.add_argument("--precision", default=None, choices=RAW_LOOPS,
                        help="default: mpt launch's --precision")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per side")
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds of A/B segments")
    parser.add_argument("--null", action="store_true",
                        help="A/A run: side 'mpt' becomes a second raw loop (the noise floor)")


def start(args: argparse.Namespace) -> tuple[mpt.Runtime, str, Callable[[], None]]:
    """The runtime (its process group serves both sides), the malloc setting, the device sync."""
    malloc = "steady" if apply_host_memory("steady") is None else "default"
    torch.manual_seed(0)  # same initial weights on every rank and on both sides
    rt = mpt.Runtime(backend="ddp", precision=args.precision)
    if not dist.is_initialized() or rt.world_size < 2:
        raise SystemExit("run this through `mpt launch --gpus 2`: it needs a process group")
    if rt.precision.name not in RAW_LOOPS:
        raise SystemExit(f"no hand-written loop for precision {rt.precision.name}; use one of "
                         f"{RAW_LOOPS}")
    sync = torch.cuda.synchronize if rt.device.type == "cuda" else (lambda: None)
    rt.print(f"{rt.world_size} processes, {dist.get_backend()} on {rt.device.type}, precision "
             f"{rt.precision.name}, torch {torch.__version__}, {torch.get_num_threads()} "
             f"thread(s)/process (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}),"
             f" malloc {malloc}")
    return rt, malloc, sync


def sides(rt: mpt.Runtime, base: nn.Module, make_optimizer: Callable[[nn.Module], Any],
          batches: Batches, loss_fn: Callable[..., torch.Tensor], null: bool
          ) -> tuple[StepFn, StepFn, tuple[torch.optim.Optimizer, ...], nn.Module, nn.Module]:
    """Side A (mpt, or a second raw loop with ``null``) and side B (raw) on copies of ``base``;
    their optimizers, and the two bare modules to compare weights after the run."""
    raw_module = copy.deepcopy(base).to(rt.device)  # copied before either side touches it
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    raw_opt = make_optimizer(raw_module)
    scaling = getattr(rt.precision, "scaling", None)
    precision, device_type = rt.precision.name, rt.device.type
    b = raw_step_fn(DistributedDataParallel(raw_module, device_ids=device_ids), raw_opt,
                    precision, device_type, scaling, batches, loss_fn, CLIP)
    a_module = base.to(rt.device)
    a_opt = make_optimizer(a_module)
    if null:
        a = raw_step_fn(DistributedDataParallel(a_module, device_ids=device_ids), a_opt,
                        precision, device_type, scaling, batches, loss_fn, CLIP)
    else:
        model, a_opt = rt.setup(a_module, a_opt)
        a = mpt_step_fn(rt, model, batches, loss_fn, CLIP)
    return a, b, (a_opt, raw_opt), a_module, raw_module
