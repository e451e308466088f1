"""`mpt plan`'s per-rank memory against the peak resident memory each rank really reaches
(issue 36: every predicted per-rank peak within +-10 % of the measured one on the CPU jobs).

    .venv/bin/mpt launch --gpus 2 --backend ddp --host-memory lean benchmarks/plan_memory.py
    .venv/bin/mpt launch --gpus 2 --backend fsdp --host-memory lean benchmarks/plan_memory.py
    .venv/bin/mpt launch --gpus 2 --backend fsdp --host-memory lean \
        benchmarks/plan_memory.py --batch 2048      # activations beside the state
    .venv/bin/mpt launch --gpus 2 --backend deepspeed --host-memory lean benchmarks/plan_memory.py
    .venv/bin/mpt launch --gpus 2 --backend fsdp --host-memory lean \
        benchmarks/plan_memory.py --model deep     # eight alike units
    .venv/bin/mpt launch --gpus 4 --pipeline-stages 2 --backend fsdp --host-memory lean \
        benchmarks/plan_memory.py                   # the fullest stage's ranks
    .venv/bin/mpt launch --gpus 2 --pipeline-stages 2 --pipeline-schedule gpipe \
        --microbatches 8 --host-memory lean benchmarks/plan_memory.py --model deep \
        --batch 2048                                # what a schedule keeps for its backwards
    .venv/bin/mpt launch --gpus 2 --backend ddp --host-memory lean --grad-compression powersgd \
        --backend-options '{"powersgd_start_step": 2}' benchmarks/plan_memory.py  # its error
    .venv/bin/mpt launch --gpus 2 --backend ddp --accumulate 4 --host-memory lean \
        benchmarks/plan_memory.py --batch 512        # 4 micro-batches of 512 a step
    .venv/bin/mpt launch --gpus 2 --backend deepspeed --zero-stage 2 --host-memory lean \
        benchmarks/plan_memory.py --phases          # up to the optimizer's step and from it

Every rank builds the MLP of tests/plan/plan_models.py (25.2 M parameters, 403 MB of fp32 Adam
state; ``--model deep``: that file's eight alike layers, 29.4 M) and trains it for ``--steps``
steps of ``--batch`` samples per replica (``rt.forward_backward``: a pipeline's micro-batches
among them), each step ``--accumulate`` such batches where the launch gives it. The kernel
keeps the process's peak resident set size (``VmHWM``, restarted just before the model is
built); the measured figure is that peak above the RSS at the restart (the
process, torch, mpt's modules and the process group are not what the model costs, and the plan
does not count them). ``--phases`` splits it where the optimizer's step starts (torch's
global pre-hook): the peak up to it (the forward, the backward and whatever the backend does
before it steps) and from it, each beside the plan's for that phase. Then the rank prices
its own launch with the cost model (``mpt.plan.cost.predict`` of the launch's backend,
precision, ranks, pipeline stages, schedule, micro-batches and batch: the memory `mpt plan`
prints for that layout, a pipeline's for its fullest stage) and rank 0 prints it beside the
highest rank's peak, with their ratio.

``--host-memory lean`` returns every freed block of 128 KiB or more to the OS at once, so the
resident set is what the run holds; under the default (``fast``) glibc keeps freed blocks for
reuse, which the resident peak includes and no count of live tensors predicts.

A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

import mpt
from mpt.estimate import meta_model
from mpt.plan.cost import Prediction, predict
from mpt.plan.layouts import layout
from mpt.plan.network import Cluster
from mpt.plan.planner import model_of
from mpt.plan.profiles import Device, link_profile

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "plan"))
import plan_models  # the models `mpt plan`'s tests price

MiB = 2**20
INPUT = 1024
"""The MLP's input features."""


def reset_peak_rss() -> int:
    """Restart the kernel's count of this process's peak resident set (``clear_refs`` 5,
    Linux >= 4.0) and return the RSS of now, where the new peak starts. The kernel's count
    misses no peak, where a sampling thread would miss the optimizer's brief temporaries."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_rss() -> int:
    """This process's peak resident set since ``reset_peak_rss``, in bytes."""
    return _status("VmHWM")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024  # kB


def predicted(rt: mpt.Runtime, build: Callable[[], torch.nn.Module], batch: int
              ) -> Prediction:
    """The cost model's row for this launch: its backend, precision, ranks, global batch and
    ``--grad-compression``.
    Of the device, memory depends only on its type (torch's Adam steps CPU tensors one at a
    time); the throughput figures below are placeholders no memory term reads."""
    net = meta_model(build)
    spec = rt.precision.spec
    pipeline = rt.config.pipeline_at(rt.world_size)
    chosen = layout(net, rt.backend.name, rt.config.backend_options, rt.topology.plan.pp, 1,
                    world=rt.world_size, precision=spec.name,
                    batch=batch * rt.topology.dp_size * rt.accumulate,
                    microbatches=pipeline.microbatches if pipeline else None,
                    compression=rt.config.grad_compression,
                    schedule=rt.config.pipeline_schedule, accumulate=rt.accumulate)
    host = Device(name="cpu", flops={"float32": 1e11}, memory_bandwidth=1e10,
                  memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                  intra_node=link_profile("10gbit"), device_type=rt.device.type)
    cluster = Cluster(nodes=1, gpus=rt.world_size, device=host, link=link_profile("1gbit"))
    return predict(chosen, model_of(net, [INPUT], torch.float32, "adam"), cluster, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64,
                        help="samples per rank and step (and micro-batch, with --accumulate)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", choices=("mlp", "deep"), default="mlp",
                        help="tests/plan/plan_models.py's model: the MLP, or eight layers of "
                        "about one size (fsdp's units alike)")
    parser.add_argument("--phases", action="store_true",
                        help="also print each rank's peak up to the optimizer's step and from "
                        "it on, beside the plan's for each")
    args = parser.parse_args()

    rt = mpt.Runtime(quiet=True)
    # torch's first optimizer imports torch._dynamo (torch/_compile.py's decorator on
    # add_param_group): 32-34 MiB of modules, the process's and not the model's; and
    # DeepSpeed's ZeRO imports a module that applies torch.compile as it loads (its Muon
    # optimizer's): 47 MiB more of torch's compiler modules, loaded here first
    import torch._dynamo
    torch.compile(lambda x: x)
    rt.barrier()
    before = reset_peak_rss()
    torch.manual_seed(rt.rank)
    build = getattr(plan_models, args.model)
    net = build()
    net, _optimizer = rt.setup(net, torch.optim.Adam(net.parameters(), lr=1e-4))
    # The kernel's peak restarts at each step and again where the optimizer's step starts:
    # the peak up to it (the forward, the backward, a backend's reductions and flattening,
    # wherever the backend runs them) and the peak from it. Each phase's highest over the
    # steps; the run's peak is the highest of both.
    before_optimizer = optimizer = peak_rss() - before  # the model and the optimizer built
    stepped = False
    def optimizer_starts(*_: object) -> None:
        nonlocal before_optimizer, stepped
        before_optimizer = max(before_optimizer, peak_rss() - before)
        stepped = True
        reset_peak_rss()
    hook = register_optimizer_step_pre_hook(optimizer_starts)
    for _ in range(args.steps * rt.accumulate):
        x = torch.randn(args.batch, INPUT, device=rt.device)
        reset_peak_rss()
        stepped = False
        rt.forward_backward(x, torch.zeros_like(x), torch.nn.functional.mse_loss)
        rt.step()
        if stepped:
            optimizer = max(optimizer, peak_rss() - before)
        else:  # a micro-batch the optimizer does not step after
            before_optimizer = max(before_optimizer, peak_rss() - before)
    hook.remove()
    rt.barrier()
    measured = max(before_optimizer, optimizer)
    # Priced after the run: profiling on meta frees memory the training would reuse unseen.
    plan = predicted(rt, build, args.batch)

    held = plan.memory
    parts = (f"parameters {held.row.parameters / MiB:.0f}, gradients "
             f"{held.row.gradients / MiB:.0f}, optimizer {held.row.optimizer / MiB:.0f}, "
             f"buffers {held.buffers / MiB:.0f}, the batch {held.batch / MiB:.0f}, then the "
             f"backward's activations {held.activations / MiB:.0f} and a gradient "
             f"accumulating {held.accumulating / MiB:.0f}, the buffers after it "
             f"{held.between / MiB:.0f} or "
             f"the step's temporaries {held.transient / MiB:.0f} and buffers "
             f"{held.stepping / MiB:.0f} less the {held.released / MiB:.0f} the backward "
             f"frees, whichever is most, MiB")
    pp = rt.topology.plan.pp
    stages = f", stage {rt.topology.stage} of {pp}" if pp > 1 else ""
    row = (f"rank {rt.rank}: {rt.backend.name}, {rt.world_size} ranks{stages}, batch "
           f"{args.batch}/replica x {rt.accumulate} accumulated, {rt.precision.spec.name}: "
           f"measured peak RSS "
           f"+{measured / MiB:.0f} MiB above {before / MiB:.0f} MiB")
    peaks: list[int] = [0] * rt.world_size
    dist.all_gather_object(peaks, measured)
    if args.phases:
        row += (f"; up to the optimizer's step +{before_optimizer / MiB:.0f} (plan "
                f"{held.before_step / MiB:.0f}), from it +{optimizer / MiB:.0f} (plan "
                f"{held.in_step / MiB:.0f})")
    for rank in range(rt.world_size):
        rt.barrier()
        if rank == rt.rank:
            print(row, flush=True)
    if rt.is_global_zero:  # a pipeline's plan prices its fullest stage: the highest peak
        print(f"predicted {plan.total_memory / MiB:.0f} MiB ({parts}); the highest rank's peak "
              f"+{max(peaks) / MiB:.0f} MiB; predicted / measured "
              f"{plan.total_memory / max(peaks):.2f}", flush=True)
    rt.close()


if __name__ == "__main__":
    main()
