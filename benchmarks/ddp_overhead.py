"""Step time of mpt's ``ddp`` backend against a hand-written DDP loop, in one run.

    .venv/bin/mpt launch --gpus 2 benchmarks/ddp_overhead.py
    .venv/bin/mpt launch --gpus 2 --precision bf16-mixed benchmarks/ddp_overhead.py
    .venv/bin/mpt launch --gpus 2 benchmarks/ddp_overhead.py --precision fp16-mixed \
        --steps 10 --warmup 20 --rounds 40
    .venv/bin/mpt launch --gpus 2 benchmarks/ddp_overhead.py --null   # A/A: the noise floor

Both loops train the same MLP (same initial weights, same batches, same AdamW, same clip) in the
same processes and on the same process group, which ``mpt.Runtime`` opens: side "mpt" goes
through ``rt.autocast/backward/clip_grad_norm_/step``; side "raw" is plain torch
(DistributedDataParallel, ``zero_grad``, forward, ``backward``, ``clip_grad_norm_``, ``step``,
with ``torch.autocast`` for bf16/fp16 and a ``torch.amp.GradScaler`` for fp16).

The timed steps come in rounds, A then B, with the side that goes first alternating, so that
machine noise falls on both. Every step is timed with ``time.perf_counter`` on every rank, with
no barrier inside the loop; between segments (outside the timed region) the ranks meet at a
barrier and take the max over ranks of each step's time. The figure per side is the median of
those per-step times; the ratio is mpt/raw. The spread is shown three ways: a bootstrap 95 %
interval of the ratio (it treats steps as independent, so it is too narrow: see ``--null``), the
per-round ratios, and the ratio of the fastest round medians.

Two things keep the sides from disturbing each other through the memory allocator they share.
After each segment both sides' gradients are freed, outside the timing (mpt frees them in
``rt.step``, the raw loop only at the start of its next step). Without that, the raw side held
6 MB of gradients through mpt's segments, mpt's side took up to ~1,000 more page faults per step
than the raw side, and fp32 ratios read 1.00-1.10 in nine runs, eight of them 1.04 or more.
And by default glibc is told to keep freed memory (``--malloc steady``), which cuts page faults
from hundreds or thousands per step to about ten, on both sides. Page faults per step are
printed, so a reader can check this.

The model is an MLP 512-1024-1024-10 (1.6 M parameters, batch 64 per process): a step of
15-25 ms on two processes of a 2-core machine, so per-step Python overhead would be visible but
is not all there is. fp16 matmuls have no fast kernel on that CPU (the same model takes ~350 ms
a step in fp16), so on CPU fp16-mixed defaults to hidden size 256 (0.2 M parameters, 12-14 ms a
step); ``--hidden`` sets it. On CUDA every step ends with ``torch.cuda.synchronize()`` on both
sides, so the GPU work is inside the timing.

``--null`` replaces the mpt side by a second copy of the raw loop: the ratio it prints is the
benchmark's own noise floor on the machine at hand.

This is a benchmark, not a test: it prints figures and never fails on them. After the run it
checks that both sides did the same arithmetic (their weights must match bit for bit).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mpt
from mpt.environments.host_memory import apply_host_memory
from mpt.precision import LossScaleConfig

GOAL = 1.02
RAW_LOOPS = ("fp32", "bf16-mixed", "fp16-mixed")  # precisions with a hand-written loop below
StepFn = Callable[[int], None]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default=None, choices=RAW_LOOPS,
                        help="default: mpt launch's --precision")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per side first")
    parser.add_argument("--rounds", type=int, default=40, help="rounds of A/B segments")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--hidden", type=int, default=None,
                        help="MLP width (default 1024; 256 for fp16-mixed on CPU)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--verbose", action="store_true", help="one line per round")
    parser.add_argument("--malloc", choices=("steady", "default"), default="steady",
                        help="steady: glibc keeps freed memory instead of returning it to the "
                             "OS (fewer page faults, less noise); default: leave malloc alone")
    parser.add_argument("--null", action="store_true",
                        help="A/A run: side 'mpt' becomes a second raw loop, so the ratio "
                             "shows the benchmark's own noise floor")
    args = parser.parse_args()
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")
    return args


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(512, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def make_batches(rank: int, batch_size: int, device: torch.device,
                 count: int = 8) -> list[tuple[torch.Tensor, ...]]:
    """A fixed cycle of batches, different per rank (as a sharded loader would give)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch_size, 512, generator=gen).to(device),
             torch.randint(0, 10, (batch_size,), generator=gen).to(device))
            for _ in range(count)]


def mpt_step_fn(rt: mpt.Runtime, model: nn.Module, batches: list[tuple[torch.Tensor, ...]],
                loss_fn: nn.Module, clip: float) -> StepFn:
    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        with rt.autocast():
            loss = loss_fn(model(x), y)
        rt.backward(loss)
        rt.clip_grad_norm_(clip)
        rt.step()
    return step


def raw_step_fn(model: nn.Module, optimizer: torch.optim.Optimizer, precision: str,
                device_type: str, scaling: LossScaleConfig | None,
                batches: list[tuple[torch.Tensor, ...]], loss_fn: nn.Module,
                clip: float) -> StepFn:
    """The loop a user would write with plain torch, per precision."""
    if precision == "fp32":
        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        return step

    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    if precision == "bf16-mixed":
        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=dtype):
                loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        return step

    # fp16-mixed: the scaler mirrors mpt's loss-scale settings, so both sides scale alike.
    cfg = scaling or LossScaleConfig()
    scaler = torch.amp.GradScaler(device_type, init_scale=cfg.init_scale,
                                  growth_factor=cfg.growth_factor,
                                  backoff_factor=cfg.backoff_factor,
                                  growth_interval=cfg.growth_interval)
    new_scale = None if cfg.dynamic else cfg.init_scale

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=dtype):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update(new_scale)
    return step


def run_segment(step: StepFn, start: int, count: int, sync: Callable[[], None]) -> list[float]:
    """``count`` steps, each timed alone; no barrier or collective of ours inside."""
    times = []
    clock = time.perf_counter
    for i in range(start, start + count):
        t0 = clock()
        step(i)
        sync()  # CUDA: wait for the step's kernels; CPU: nothing to wait for
        times.append(clock() - t0)
    return times


def max_over_ranks(times: list[float]) -> torch.Tensor:
    """Per-step max across ranks, in ms (a collective, run outside the timed region)."""
    t = torch.tensor(times, dtype=torch.float64) * 1e3
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return t


def median(t: torch.Tensor) -> float:
    return float(torch.quantile(t, 0.5))


def bootstrap_ratio(a: torch.Tensor, b: torch.Tensor, n: int) -> tuple[float, float]:
    """95 % interval of median(a)/median(b), resampling the steps of each side."""
    gen = torch.Generator().manual_seed(0)
    ra = a[torch.randint(len(a), (n, len(a)), generator=gen)].quantile(0.5, dim=1)
    rb = b[torch.randint(len(b), (n, len(b)), generator=gen)].quantile(0.5, dim=1)
    lo, hi = torch.quantile(ra / rb, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(lo), float(hi)


def main() -> None:
    args = parse_args()
    steady = args.malloc == "steady" and apply_host_memory("steady") is None
    malloc = "steady" if steady else "default"
    torch.manual_seed(0)  # same initial weights on every rank and on both sides
    rt = mpt.Runtime(backend="ddp", precision=args.precision)
    if not dist.is_initialized() or rt.world_size < 2:
        raise SystemExit("run this through `mpt launch --gpus 2`: it needs a process group")
    precision = rt.precision.name
    if precision not in RAW_LOOPS:
        raise SystemExit(f"no hand-written loop for precision {precision}; use one of {RAW_LOOPS}")
    device_type = rt.device.type
    hidden = args.hidden or (256 if precision == "fp16-mixed" and device_type == "cpu" else 1024)
    sync: Callable[[], None] = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    load_before = os.getloadavg()[0]

    base = make_model(hidden)
    raw_module = copy.deepcopy(base)  # copied before either side touches it
    n_params = sum(p.numel() for p in base.parameters())
    loss_fn = nn.CrossEntropyLoss()
    clip = 1.0
    batches = make_batches(rt.rank, args.batch_size, rt.device)

    # The raw side: plain torch on the process group the runtime opened.
    raw_module = raw_module.to(rt.device)
    raw_opt = torch.optim.AdamW(raw_module.parameters(), lr=1e-3)
    device_ids = [rt.device.index] if device_type == "cuda" else None
    raw_model = DistributedDataParallel(raw_module, device_ids=device_ids)
    scaling = getattr(rt.precision, "scaling", None)

    mpt_opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    if args.null:  # a second raw loop in mpt's place, on the other (identical) model copy
        mpt_model = DistributedDataParallel(base.to(rt.device), device_ids=device_ids)
        a_step = raw_step_fn(mpt_model, mpt_opt, precision, device_type, scaling, batches,
                             loss_fn, clip)
    else:
        mpt_model, mpt_opt = rt.setup(base, mpt_opt)
        a_step = mpt_step_fn(rt, mpt_model, batches, loss_fn, clip)
    sides: dict[str, StepFn] = {
        "mpt": a_step,
        "raw": raw_step_fn(raw_model, raw_opt, precision, device_type, scaling, batches,
                           loss_fn, clip),
    }
    optimizers = {"mpt": mpt_opt, "raw": raw_opt}
    cursor = {"mpt": 0, "raw": 0}  # each side walks the same batch sequence
    a = "raw2" if args.null else "mpt"  # how side A is named in what is printed

    rt.print(f"ddp overhead: {rt.world_size} processes, {dist.get_backend()} on {device_type}, "
             f"precision {precision}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} thread(s)/process "
             f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), malloc {malloc}")
    rt.print(f"model: MLP 512-{hidden}-{hidden}-10, {n_params:,} parameters, "
             f"batch {args.batch_size}/process, AdamW, clip {clip}")
    rt.print(f"{args.warmup} warm-up steps per side, then {args.rounds} rounds x {args.steps} "
             f"timed steps per side (A/B, alternating first); per-step time = max over ranks")

    for name, step in sides.items():  # warm-up, not timed
        for i in range(args.warmup):
            step(i)
        cursor[name] = args.warmup

    all_times: dict[str, list[torch.Tensor]] = {"mpt": [], "raw": []}
    faults = {"mpt": 0, "raw": 0}  # minor page faults in the timed segments, this rank
    if args.verbose:
        rt.print(f"{'round':>5} {'first':>5} {a + ' ms':>8} {'raw ms':>8} {'ratio':>7}")
    for r in range(args.rounds):
        order = ("mpt", "raw") if r % 2 == 0 else ("raw", "mpt")
        for name in order:
            gc.collect()
            dist.barrier()  # both ranks enter the segment together; outside the timing
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            times = run_segment(sides[name], cursor[name], args.steps, sync)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            # Leave both sides in the same state while the other one runs: mpt frees its
            # gradients at the end of rt.step, the raw loop only at the start of its next step.
            # Holding 6 MB of gradients across the other side's segment changes where the
            # allocator puts that side's buffers, and was seen to cost mpt ~1,000 extra page
            # faults and ~5 % per step. Outside the timing; a no-op for mpt.
            optimizers[name].zero_grad(set_to_none=True)
            cursor[name] += args.steps
            all_times[name].append(max_over_ranks(times))
        if args.verbose:
            m, w = median(all_times["mpt"][-1]), median(all_times["raw"][-1])
            first = a if order[0] == "mpt" else "raw"
            rt.print(f"{r:>5} {first:>5} {m:8.3f} {w:8.3f} {m / w:7.3f}")

    mpt_t, raw_t = torch.cat(all_times["mpt"]), torch.cat(all_times["raw"])
    mpt_ms, raw_ms = median(mpt_t), median(raw_t)
    ratio = mpt_ms / raw_ms
    lo, hi = bootstrap_ratio(mpt_t, raw_t, args.bootstrap)
    round_ratios = [median(a) / median(b)
                    for a, b in zip(all_times["mpt"], all_times["raw"], strict=True)]
    best_mpt = min(median(a) for a in all_times["mpt"])
    best_raw = min(median(b) for b in all_times["raw"])

    # Same init, same data, same arithmetic: the weights must agree, or the loops differ.
    with torch.no_grad():
        pairs = zip(rt.backend.unwrap(mpt_model).parameters(), raw_module.parameters(),
                    strict=True)
        diff = max(float((p - q).abs().max()) for p, q in pairs)

    rt.print(f"median step: {a} {mpt_ms:.3f} ms, raw {raw_ms:.3f} ms "
             f"({len(mpt_t)} steps per side); p10/p90 {a} "
             f"{float(mpt_t.quantile(0.1)):.3f}/{float(mpt_t.quantile(0.9)):.3f}, raw "
             f"{float(raw_t.quantile(0.1)):.3f}/{float(raw_t.quantile(0.9)):.3f} ms")
    rt.print(f"spread: bootstrap 95% CI of the ratio [{lo:.3f}, {hi:.3f}]; fastest round "
             f"medians {a} {best_mpt:.3f} ms, raw {best_raw:.3f} ms, ratio "
             f"{best_mpt / best_raw:.3f}")
    rt.print(f"per-round ratios: median {statistics.median(round_ratios):.3f}, range "
             f"{min(round_ratios):.3f}..{max(round_ratios):.3f}")
    rt.print(f"check: max |w_{a} - w_raw| after {cursor['mpt']} steps = {diff:.3g}"
             f"{'' if diff == 0 else '  (NOT identical)'}")
    timed = args.rounds * args.steps
    rt.print(f"minor page faults per step (rank 0): {a} {faults['mpt'] / timed:.0f}, "
             f"raw {faults['raw'] / timed:.0f}; machine load (1-min average) "
             f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    if args.null:
        rt.print("NULL RUN: side A was a second raw loop, not mpt; the ratio is pure noise")
    label = f"ddp {precision}{' (null)' if args.null else ''}"
    rt.print(f"{label}: {a} {mpt_ms:.2f} ms, raw {raw_ms:.2f} ms, ratio {ratio:.3f} "
             f"(goal <= {GOAL})")
    rt.close()


if __name__ == "__main__":
    main()
