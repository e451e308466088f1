"""Pipeline stages against their ideal: step time and each stage's share of the training state.

    .venv/bin/python benchmarks/pipeline.py [--stages 2] [--microbatches 8] [--steps 12]

Runs `mpt launch` several times on this machine: examples/gpt.py's model trained by one process
(P = 1), then by P processes under each schedule (gpipe, 1f1b, interleaved-1f1b), every one with
one intra-op thread per process so that P processes use P cores and the one-process run one.
Each prints:

- the median step time against the ideal ``(T_one / P) x (M + P - 1) / M`` (the bubble of GPipe
  and 1F1B; interleaved 1F1B's is smaller, so its ratio may fall below 1);
- each stage's parameters + gradients + optimizer state, in bytes, against the one-process
  figure (the shared embedding/output weight counts on both stages that hold it).

Goals (issue 24): 1F1B step <= 1.15 x the ideal at P = 2, M = 8; each stage <= 0.55 x the state.

    .venv/bin/python benchmarks/pipeline.py --replicas 2 --backend fsdp

runs P x D processes, each stage's D replicas under --backend (fsdp shards the stage over them:
each rank's state about 1 / (P x D) of the one-process figure; ddp: 1 / P).

    .venv/bin/python benchmarks/pipeline.py --crossover [--rate 1gbit] [--width 1024]

runs on two emulated nodes (mpt.cluster; needs root) joined by links of --rate, one process per
node, an MLP of --layers Linear layers --width wide, for batch sizes from 16 up: P = 2 (a stage
per node: activations cross the link) against D = 2 (DDP: the gradients' allreduce crosses it),
and prints where P = 2 stops beating D = 2. With ``--calibration FILE`` (`mpt plan --calibrate
--nodes 2` on two such nodes) it prints `mpt plan`'s prediction of both beside them.

    .venv/bin/python benchmarks/pipeline.py --schedules [--rate 1gbit] [--batch-size 256] \
        [--calibration FILE]

runs P = 2 on two such nodes (8 Linear(1024, 1024) + ReLU) under every schedule at M = 2, 4,
8 and 16, beside `mpt plan`'s step of each: calibrated first on two nodes shaped alike
(`mpt plan benchmarks/pipeline.py:mlp --calibrate --nodes 2`, into FILE, or FILE as it is
where it exists), and whether the plan's first of them measured within 10 % of the best.

    .venv/bin/python benchmarks/pipeline.py --accumulations [--rate 1gbit] [--batch-size 256] \
        [--calibration FILE]

runs the same MLP as D = 2 (``--backend``, ddp by default, a replica per node) with
``--accumulate`` 1, 2, 4 and 8, beside `mpt plan`'s step of each, calibrated alike.
A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def state_bytes(model: Any, optimizer: Any) -> int:
    """Parameters, their gradients and the optimizer's tensors held by this rank (a DTensor's
    local shard under fsdp)."""
    import torch
    from torch.distributed.tensor import DTensor

    def held(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(held(p) for p in params)
    total += sum(held(p.grad) for p in params if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(held(t) for t in state.values() if isinstance(t, torch.Tensor))
    return total


def worker(args: argparse.Namespace) -> None:
    """Under `mpt launch`: train the GPT for --steps steps; rank 0 of each stage writes its
    step times and state bytes."""
    import torch
    import torch.nn.functional as F
    from gpt import GPT, GPTConfig
    from torch import nn

    import mpt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rt = mpt.Runtime(quiet=True)
    g = torch.Generator().manual_seed(1)
    # per replica and micro-batch: the global batch is kept
    batch = args.batch_size // rt.topology.dp_size // rt.accumulate
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    if args.width:  # the crossover's MLP: gradients large next to its activations
        model: nn.Module = nn.Sequential(*(layer for _ in range(args.layers) for layer in (
            nn.Linear(args.width, args.width), nn.ReLU())))
        x = torch.randn(batch, args.width, generator=g).to(rt.device)
        y = torch.randn(batch, args.width, generator=g).to(rt.device)
        loss_fn = F.mse_loss
    else:
        model = GPT(GPTConfig(vocab=64, block=args.block, layers=args.layers, heads=4,
                              embed=args.embed))
        x = torch.randint(64, (batch, args.block), generator=g).to(rt.device)
        y = torch.randint(64, (batch, args.block), generator=g).to(rt.device)

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    times = []
    for _ in range(args.steps):
        rt.barrier()
        start = time.perf_counter()
        for _ in range(rt.accumulate):  # the last micro-batch's rt.step steps
            rt.forward_backward(x, y, loss_fn)
            rt.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        times.append(rt.all_reduce(elapsed, op="max").item())  # the slowest stage's step
    own = torch.tensor([float(state_bytes(model, optimizer))])
    everyone = [torch.zeros(1) for _ in range(rt.world_size)]
    torch.distributed.all_gather(everyone, own) if rt.world_size > 1 else everyone[0].copy_(own)
    if rt.rank == 0:
        Path(args.out).write_text(json.dumps({
            "times": times, "state": [t.item() for t in everyone]}))
    rt.close()


def worker_args(args: argparse.Namespace, out: Path) -> list[str]:
    return [__file__, "--worker", "--out", str(out), "--steps", str(args.steps), "--layers",
            str(args.layers), "--embed", str(args.embed), "--block", str(args.block),
            "--batch-size", str(args.batch_size), "--width", str(args.width)]


def launch(args: argparse.Namespace, gpus: int, *flags: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out.json"
        command = [sys.executable, "-m", "mpt", "launch", "--gpus", str(gpus), "--quiet",
                   *flags, *worker_args(args, out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env, cwd=ROOT)
        return json.loads(out.read_text())


def on_two_nodes(args: argparse.Namespace, *flags: str) -> float:
    """The median step of a job of two emulated nodes, one process each, under the
    ``--host-memory`` that `mpt plan`'s launch line carries on a CPU host (what it prices)."""
    from mpt.cluster import EmulatedCluster, LinkShape, launch_command, run_nodes
    from mpt.plan.profiles import CPU_HOST_MEMORY

    with tempfile.TemporaryDirectory() as folder, EmulatedCluster(
            nodes=2, shape=LinkShape(rate=args.rate)) as cluster:
        out = Path(folder) / "out.json"
        script, *script_args = worker_args(args, out)
        commands = [launch_command(cluster, nr, script, script_args,
                                   launch_args=["--quiet", "--host-memory", CPU_HOST_MEMORY,
                                                *flags]) for nr in range(2)]
        run = run_nodes(cluster, commands, timeout=600, env={"OMP_NUM_THREADS": "1"}, cwd=ROOT)
        if not run.ok:
            raise SystemExit(run.report())
        return statistics.median(json.loads(out.read_text())["times"][2:])


def crossover(args: argparse.Namespace) -> None:
    """P = 2 against D = 2 across the link, batch by batch, until D = 2 wins."""
    grads = args.layers * (args.width * args.width + args.width) * 4
    print(f"MLP {args.layers} x {args.width} ({grads / 1e6:.1f} MB of fp32 gradients), "
          f"2 nodes x 1 process, links of {args.rate}, M = {args.microbatches}")
    print(f"{'global batch':>12}{'P=2 ms':>9}{'D=2 ms':>9}{'activations MB':>16}  faster")
    predicted = planned(args) if args.calibration else None
    batch = 16
    while batch <= args.max_batch:
        args.batch_size = batch
        pipe = on_two_nodes(args, "--pipeline-stages", "2", "--microbatches",
                            str(args.microbatches))
        data = on_two_nodes(args)
        sent = 2 * batch * args.width * 4 / 1e6  # forward activations and their gradients
        plan = ""
        if predicted is not None:
            p2, d2 = predicted(batch)
            plan = (f"  planned P=2 {p2 * 1e3:.1f} ms ({p2 / pipe:.2f}), D=2 {d2 * 1e3:.1f} ms "
                    f"({d2 / data:.2f}): {'P=2' if p2 < d2 else 'D=2'}")
        print(f"{batch:>12}{pipe * 1e3:>9.1f}{data * 1e3:>9.1f}{sent:>16.2f}  "
              f"{'P=2' if pipe < data else 'D=2'}{plan}")
        if data <= pipe:
            break
        batch *= 4


def planned(args: argparse.Namespace) -> Callable[[int], tuple[float, float]]:
    """`mpt plan`'s step of P = 2 (M = --microbatches) and of D = 2 at a global batch, on two
    nodes of ``--calibration``'s figures and its link measured across them, its compute scaled
    by the model's own step where the calibration timed this MLP's (``mlp()``'s, by
    `mpt plan benchmarks/pipeline.py:mlp --calibrate`)."""
    import torch
    from torch import nn

    from mpt.estimate import meta_model
    from mpt.plan import calibrate
    from mpt.plan.cost import predict
    from mpt.plan.layouts import layout
    from mpt.plan.network import Cluster
    from mpt.plan.planner import measured_model
    from mpt.precision import describe

    found = calibrate.load(Path(args.calibration))
    link = found.measured_link(args.calibration)
    if link is None:
        raise SystemExit(f"{args.calibration} measured no link: run `mpt plan --calibrate "
                         "--nodes 2` on the two nodes")
    cluster = Cluster(nodes=2, gpus=1, device=found.device(args.calibration), link=link)
    net = meta_model(lambda: nn.Sequential(*(layer for _ in range(args.layers) for layer in (
        nn.Linear(args.width, args.width), nn.ReLU()))))
    spec = describe("fp32")
    model, compute = measured_model(net, cluster, spec, [args.width], torch.float32, "adamw",
                                    found.measured_step())
    print(f"planned with compute {compute}")

    def steps(batch: int) -> tuple[float, float]:
        return tuple(predict(layout(net, "ddp", {}, pp, 1, world=2, precision="fp32",
                                    batch=batch, microbatches=args.microbatches if pp > 1
                                    else None), model, cluster, spec).step for pp in (2, 1))

    return steps


def mlp() -> Any:
    """The MLP of ``--schedules`` (8 Linear(1024, 1024) + ReLU), for `mpt plan
    benchmarks/pipeline.py:mlp --calibrate` to time its own step."""
    from torch import nn

    return nn.Sequential(*(layer for _ in range(8) for layer in (nn.Linear(1024, 1024),
                                                                 nn.ReLU())))


def schedules(args: argparse.Namespace) -> None:
    """P = 2 on two nodes at --rate under every schedule and M of 2, 4, 8, 16, measured
    against `mpt plan`'s step of each (calibrated on two such nodes, its compute scaled by the
    MLP's own step), and whether the plan's first of them measured within 10 % of the best."""
    from mpt.pipeline.config import SCHEDULES
    from mpt.plan.layouts import MICROBATCHES

    figures, out = _calibrated_mlp(args)
    ranked = planned_schedules(args, figures)
    print(f"MLP 8 x 1024, P = 2 over 2 nodes x 1 process, links of {args.rate}, global batch "
          f"{args.batch_size}; planned from {out}")
    print(f"{'schedule':<18}{'M':>4}{'measured ms':>13}{'planned ms':>12}{'ratio':>7}"
          f"{'plan rank':>11}")
    measured = {}
    for schedule in SCHEDULES:
        for m in (f * 2 for f in MICROBATCHES):
            if args.batch_size % m:
                continue
            step = on_two_nodes(args, "--pipeline-stages", "2", "--pipeline-schedule",
                                schedule, "--microbatches", str(m))
            measured[schedule, m] = step
            plan, rank = ranked[schedule, m]
            print(f"{schedule:<18}{m:>4}{step * 1e3:>13.1f}{plan * 1e3:>12.1f}"
                  f"{plan / step:>7.2f}{rank:>11}", flush=True)
    first = min(measured, key=lambda key: ranked[key][1])
    best = min(measured, key=lambda key: measured[key])
    print(f"plan's first: {first[0]} M = {first[1]}, measured {measured[first] * 1e3:.1f} ms, "
          f"{measured[first] / measured[best] - 1:+.1%} against the measured best "
          f"({best[0]} M = {best[1]}, {measured[best] * 1e3:.1f} ms)")


def _calibrated_mlp(args: argparse.Namespace) -> tuple[Any, Path]:
    """Two nodes at --rate calibrated for ``mlp()`` at --batch-size (`mpt plan
    benchmarks/pipeline.py:mlp --calibrate --nodes 2`), into --calibration or reused from it,
    and that file; the workers train ``mlp()`` from here on."""
    from plan_cluster import run_calibration

    args.width, args.layers = 1024, 8  # mlp(): what the calibration times
    out = Path(args.calibration or f"calibration-pipeline-{args.rate}-{args.batch_size}.json")
    return run_calibration(
        [sys.executable, "-m", "mpt", "plan", f"{__file__}:mlp", "--calibrate", "--optimizer",
         "adamw", "--batch", str(args.batch_size)], 2, args.rate, out, reuse=True), out


def planned_schedules(args: argparse.Namespace, figures: Any
                      ) -> dict[tuple[str, int], tuple[float, int]]:
    """`mpt plan`'s step of ddp at P = 2 under each schedule and M, and its place in the
    plan's ranking, on the calibration's device and the link it measured."""
    return {(p.layout.schedule, p.layout.microbatches): (p.step, rank)
            for rank, p in enumerate(_plan_on_two_nodes(args, figures))
            if p.layout.backend == "ddp" and p.layout.plan.pp == 2}


def _plan_on_two_nodes(args: argparse.Namespace, figures: Any) -> Any:
    """`mpt plan`'s layouts of ``mlp()`` that fit two nodes of the calibration's device and
    the link it measured, fastest first."""
    import torch

    from mpt.estimate import meta_model
    from mpt.plan.network import Cluster
    from mpt.plan.planner import plan

    cluster = Cluster(nodes=2, gpus=1, device=figures.device("the calibration"),
                      link=figures.measured_link("the calibration"))
    return plan(meta_model(mlp), cluster, precision="fp32", batch=args.batch_size,
                input_shape=[1024], input_dtype=torch.float32, optimizer="adamw",
                step=figures.measured_step()).fitting


def accumulations(args: argparse.Namespace) -> None:
    """D = 2 on two nodes at --rate under --backend with --accumulate 1, 2, 4 and 8,
    measured against `mpt plan`'s step of each (calibrated as for ``--schedules``)."""
    from plan_cluster import LABELS

    from mpt.plan.layouts import MICROBATCHES

    figures, out = _calibrated_mlp(args)
    label = LABELS.get(args.backend, f"--backend {args.backend}")  # ZeRO-1 for deepspeed
    ranked = {p.layout.label: (p.step, rank)
              for rank, p in enumerate(_plan_on_two_nodes(args, figures))}
    print(f"MLP 8 x 1024, D = 2 under {args.backend} over 2 nodes x 1 process, links of "
          f"{args.rate}, global batch {args.batch_size}; planned from {out}")
    print(f"{'accumulate':>10}{'measured ms':>13}{'planned ms':>12}{'ratio':>7}{'plan rank':>11}")
    for a in MICROBATCHES:
        if (args.batch_size // 2) % a:
            continue
        step = on_two_nodes(args, *label.split(), "--accumulate", str(a))
        plan, rank = ranked[label + (f" --accumulate {a}" if a > 1 else "")]
        print(f"{a:>10}{step * 1e3:>13.1f}{plan * 1e3:>12.1f}{plan / step:>7.2f}{rank:>11}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="timed steps (the first 2 warm up)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="global, over replicas")
    parser.add_argument("--replicas", type=int, default=1, help="D: data-parallel replicas of "
                        "each stage (P x D processes)")
    parser.add_argument("--backend", default="ddp", help="the replicas' backend: ddp, or fsdp "
                        "(each stage sharded over its D replicas)")
    parser.add_argument("--crossover", action="store_true",
                        help="P = 2 against D = 2 on two emulated nodes (root)")
    parser.add_argument("--rate", default="1gbit",
                        help="--crossover, --schedules: each node's link")
    parser.add_argument("--width", type=int, default=0, help="an MLP this wide, not the GPT")
    parser.add_argument("--max-batch", type=int, default=4096, help="--crossover: last batch")
    parser.add_argument("--calibration", help="--crossover: `mpt plan`'s prediction from this "
                        "calibration of two nodes; --schedules: the calibration to make there "
                        "or reuse (default: calibration-pipeline-RATE-BATCH.json here)")
    parser.add_argument("--schedules", action="store_true",
                        help="every schedule and M at P = 2 on two emulated nodes (root), "
                        "against `mpt plan` (calibrated there first, or --calibration FILE)")
    parser.add_argument("--accumulations", action="store_true",
                        help="D = 2 with --accumulate 1, 2, 4, 8 on two emulated nodes (root), "
                        "against `mpt plan` (calibrated as for --schedules)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.schedules:
        schedules(args)
        return
    if args.accumulations:
        accumulations(args)
        return
    if args.crossover:
        args.width = args.width or 1024
        crossover(args)
        return
    p, m = args.stages, args.microbatches
    one = launch(args, 1)
    t_one = statistics.median(one["times"][2:])
    print(f"GPT {args.layers} layers x {args.embed}, context {args.block}, batch "
          f"{args.batch_size}; P = {p}, M = {m}; one process: {t_one * 1e3:.1f} ms per step, "
          f"{one['state'][0] / 2**20:.1f} MiB of state")
    d = args.replicas
    if p * d > (os.cpu_count() or 1):
        print(f"({p * d} processes share {os.cpu_count()} cores: the step times say nothing "
              "here, the state per rank does)")
    print(f"{'schedule':<18}{'step ms':>9}{'ideal ms':>10}{'ratio':>7}   state per rank / one "
          f"(rank = stage x {d} + replica, --backend {args.backend})")
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        run = launch(args, p * d, "--backend", args.backend, "--pipeline-stages", str(p),
                     "--pipeline-schedule", schedule, "--microbatches", str(m))
        step = statistics.median(run["times"][2:])
        ideal = t_one / (p * d) * (m + p - 1) / m
        shares = " ".join(f"{s / one['state'][0]:.3f}" for s in run["state"])
        print(f"{schedule:<18}{step * 1e3:>9.1f}{ideal * 1e3:>10.1f}{step / ideal:>7.3f}   "
              f"{shares}")


if __name__ == "__main__":
    main()
