"""What recording metrics and showing progress costs a training step, in one run.

    .venv/bin/mpt launch --gpus 2 benchmarks/metrics_overhead.py
    .venv/bin/mpt launch --gpus 2 benchmarks/metrics_overhead.py --hidden 64   # ~1 ms steps
    .venv/bin/mpt launch --gpus 2 benchmarks/metrics_overhead.py --null        # noise floor

The same ``mpt.Runtime`` training loop runs in rounds of two segments: one with the run's
``Monitor`` switched on (progress on rank 0, metrics.jsonl and TensorBoard files on every rank, a
record every ``--log-every`` steps) and one with an inactive monitor (what ``--quiet`` without
``--run-dir`` gives), the side that goes first alternating. A segment is timed whole, because a
record's cost falls on one step in ``--log-every``: a per-step median would not see it. Segments
hold a whole number of records. Per round, each side's time per step is the max over ranks; the
figure is the median over rounds of on/off, with the quartiles of the per-round ratios.

A second figure does not depend on machine noise: the time spent inside the monitor's hooks
(``on_backward``, ``on_grad_norm``, ``on_step``, records included) per step, against the step.
It leaves out the threads that draw the bar and write TensorBoard files; the ratio includes them.

``--null`` makes both sides inactive: its ratio is the benchmark's own noise floor.
Run it under ``script -qc "..." /dev/null`` to put rank 0's output on a terminal (rich bar).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import mpt
from mpt.metrics import MetricsConfig, Monitor


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--records", type=int, default=3, help="records per segment")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first")
    parser.add_argument("--null", action="store_true", help="both sides without metrics")
    return parser.parse_args()


def timed(hook: Callable[..., None], totals: dict[str, float], name: str
          ) -> Callable[..., None]:
    """``hook``, adding the seconds spent in it to ``totals[name]``."""
    clock = time.perf_counter
    totals[name] = 0.0

    def wrapper(*args: object) -> None:
        start = clock()
        hook(*args)
        totals[name] += clock() - start
    return wrapper


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="mpt-metrics-bench-") as tmp:
        rt = mpt.Runtime(quiet=True)  # the monitors below replace this inactive one
        config = (MetricsConfig(quiet=True) if args.null else
                  MetricsConfig(run_dir=Path(tmp), log_every=args.log_every, all_ranks=True))
        on = Monitor(config, rank=rt.rank, device=rt.device, precision=rt.precision,
                     meta={"benchmark": "metrics_overhead"})
        off = Monitor(MetricsConfig(quiet=True), rank=rt.rank, device=rt.device,
                      precision=rt.precision, meta={})
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, args.hidden), nn.ReLU(),
                              nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                              nn.Linear(args.hidden, 10))
        model, _ = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        gen = torch.Generator().manual_seed(rt.rank)
        batches = [(torch.randn(args.batch_size, 512, generator=gen).to(rt.device),
                    torch.randint(0, 10, (args.batch_size,), generator=gen).to(rt.device))
                   for _ in range(8)]
        on.samples_per_step = args.batch_size * rt.world_size
        on.set_total(args.rounds * args.records * args.log_every)
        inside: dict[str, float] = {}
        for hook in ("on_backward", "on_grad_norm", "on_step"):
            setattr(on, hook, timed(getattr(on, hook), inside, hook))
        loss_fn = nn.CrossEntropyLoss()
        sync = torch.cuda.synchronize if rt.device.type == "cuda" else (lambda: None)

        def segment(monitor: Monitor, steps: int) -> float:
            rt.monitor = monitor
            rt.barrier()
            start = time.perf_counter()
            for i in range(steps):
                x, y = batches[i % len(batches)]
                with rt.autocast():
                    loss = loss_fn(model(x), y)
                rt.backward(loss)
                rt.clip_grad_norm_(1.0)
                rt.step()
            sync()
            seconds = torch.tensor((time.perf_counter() - start) / steps, dtype=torch.float64)
            return rt.all_reduce(seconds, op="max").item()

        segment(off, args.warmup)
        steps = args.records * args.log_every
        ratios, on_times, off_times = [], [], []
        for round_ in range(args.rounds):
            if round_ % 2:
                t_on, t_off = segment(on, steps), segment(off, steps)
            else:
                t_off, t_on = segment(off, steps), segment(on, steps)
            ratios.append(t_on / t_off)
            on_times.append(t_on)
            off_times.append(t_off)
        on.close()
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        rt.print(f"metrics overhead ({'null: both off' if args.null else 'on vs off'}), "
                 f"{rt.world_size} process(es), {rt.device.type}, precision {rt.precision.name}, "
                 f"hidden {args.hidden}, log every {args.log_every} steps, {args.rounds} rounds "
                 f"of {steps} steps per side")
        rt.print(f"  step time: on {statistics.median(on_times) * 1e3:.3f} ms, off "
                 f"{statistics.median(off_times) * 1e3:.3f} ms (medians over rounds)")
        per_step = sum(inside.values()) / (args.rounds * steps)
        hooks = ", ".join(f"{k} {v / (args.rounds * steps) * 1e6:.1f}" for k, v in inside.items())
        rt.print(f"  inside the monitor: {per_step * 1e6:.1f} us per step on rank {rt.rank} "
                 f"({hooks}), {per_step / statistics.median(on_times):.3%} of a step")
        rt.print(f"  ratio on/off: median {median:.4f} (quartiles {q1:.4f} .. {q3:.4f}); "
                 f"goal < 1.01")
        rt.close()


if __name__ == "__main__":
    main()
