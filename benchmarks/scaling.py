"""Scaling over nodes on an emulated cluster, against the ring-allreduce bound and the raw library.

    sudo .venv/bin/python benchmarks/scaling.py                       # the whole grid (long)
    .venv/bin/python benchmarks/scaling.py --models mlp --backends ddp,horovod --nodes 1,2 \
        --rates 1gbit,100gbit

Each cell is one job on ``mpt.cluster``: N nodes (network namespaces) x 1 process, each node's
link shaped by a tc token bucket, every node its own `mpt launch --nr i --backend B`. Inside that
job the same processes train two copies of the model in alternating rounds: **mpt** (``rt.setup``,
``rt.backward``, ``rt.step``) and **raw**, the library by hand on the process group mpt opened
(torch DDP for ddp and apex, ``hvd.DistributedOptimizer`` for horovod, ``deepspeed.initialize``
with the config mpt built, ``fully_shard`` on the units mpt's fsdp picks; plain torch on one
node). Same weights, same batches (8 per process, fp32), SGD with momentum. With ``--mpt-only``
each job trains mpt's loop alone: the twin's allocations in the same process slow mpt's step
(ResNet-18 at one node: 0.097-0.113 s under fsdp with the twin, 0.066-0.083 alone; ddp
0.044-0.049 against 0.036-0.051), so a step to compare with a prediction is timed alone.

Per cell it prints the median step time (max over ranks of each step), samples/s, scaling
efficiency (throughput at N / (N x throughput at 1 node, same backend)), the ring-allreduce bound
of the gradients, 2(N-1)/N x bytes / rate, the bound of the bytes each node actually sent
(``/sys/class/net/eth0`` of its namespace, per step) / rate: T_sent, the overlap and the ratio
mpt/raw.

On a machine with fewer cores than nodes, the nodes share CPUs: 4 nodes on 2 cores compute ~2x
slower per step, whatever the network. So every N is also run on an unshaped link (``100gbit``:
tbf then never limits; the veth itself moves ~8 Gbit/s here), and that cell's step is the
compute (with CPU sharing) of N nodes: T_compute(N). The overlap is
(T_compute(N) + T_sent - T_step) / min(T_compute(N), T_sent): 1 when communication hides
entirely behind compute, 0 when they add up. This is a benchmark: it prints figures and never
fails on them. Results also go to runs/scaling/results.json, the plot to
runs/scaling/efficiency.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from mpt.environments.host_memory import HOST_MEMORY

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8
UNSHAPED = "100gbit"


GPT = {"vocab": 256, "block": 64, "layers": 4, "heads": 8, "embed": 512}
"""examples/gpt.py's model for ``--models gpt``: 12.8 M parameters (51.1 MB of fp32
gradients), 64 tokens per sample."""


def build_model(name: str):  # -> nn.Module (torch is imported inside, for the driver's sake)
    """The communication-bound MLP (25.2 M parameters, 100.7 MB of fp32 gradients),
    examples/imagenet.py's default model (torchvision's ResNet-18, 10 classes, 32 px) or
    examples/gpt.py's model of ``GPT``'s shape."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 1024))
    if name == "gpt":
        sys.path.insert(0, str(ROOT / "examples"))
        from gpt import GPT as Model
        from gpt import GPTConfig

        return Model(GPTConfig(**GPT))
    import torchvision

    return torchvision.models.get_model("resnet18", weights=None, num_classes=10)


def loss_of(name: str):  # -> the loss of ``name``'s output and target
    from torch import nn

    if name == "mlp":
        return nn.MSELoss()
    if name == "gpt":  # logits (batch, tokens, vocab) against the next tokens
        return lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    return nn.CrossEntropyLoss()


def batches(name: str, rank: int, count: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    if name == "mlp":
        return [(torch.randn(BATCH, 1024, generator=g), torch.randn(BATCH, 1024, generator=g))
                for _ in range(count)]
    if name == "gpt":
        shape = (BATCH, GPT["block"])
        return [(torch.randint(0, GPT["vocab"], shape, generator=g),
                 torch.randint(0, GPT["vocab"], shape, generator=g)) for _ in range(count)]
    return [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,),
                                                                        generator=g))
            for _ in range(count)]


def tx_bytes() -> int:
    """Bytes this node's interface has sent (0 outside an emulated node)."""
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except OSError:
        return 0


def raw_side(backend: str, model, rt, loss_fn):
    """The library by hand on ``model`` (a twin of mpt's) with ``loss_fn``, its gradients
    reduced as the run's ``--grad-compression`` says (none, fp16, bf16), DDP's buckets capped
    at its ``--bucket-mb`` (Horovod's fusion threshold and DeepSpeed's buckets are the ones mpt
    set in the same process): a step function."""
    import torch
    from torch import nn

    from mpt.backends.ddp import CAST_DTYPES, CAST_HOOKS

    compression, bucket_mb = rt.config.grad_compression, rt.config.bucket_mb
    wire = CAST_DTYPES.get(compression)

    def sgd_step(module, opt):
        """The plain loop's step, on ``module`` (a DDP wrapper, a sharded or a plain model)."""
        def step(x, y) -> None:
            opt.zero_grad()  # to None (torch's default; Horovod's wrapper takes no argument)
            loss_fn(module(x), y).backward()
            opt.step()
        return step

    if rt.world_size == 1:  # one process: the raw job is plain torch, whatever the library
        return sgd_step(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    if compression == "powersgd":
        raise SystemExit("no raw PowerSGD loop: torch's hook on gloo hangs with two buckets or "
                         "more (mpt.backends.powersgd); run it with --mpt-only")
    if backend in ("ddp", "apex"):
        ddp = nn.parallel.DistributedDataParallel(
            model, **({} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}))
        if compression in CAST_HOOKS:  # torch's own hooks: cast each bucket, reduce, back
            ddp.register_comm_hook(None, CAST_HOOKS[compression])
        return sgd_step(ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9))
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return sgd_step(model, hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none))
    if backend == "deepspeed":
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
            config=rt.backend.config, dist_init_required=False)

        def step(x, y) -> None:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        return step
    if backend == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from mpt.backends.fsdp import units

        mesh = init_device_mesh("cpu", (rt.world_size,))
        policy = MixedPrecisionPolicy(reduce_dtype=wire)
        for unit in units(model, None):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return sgd_step(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    raise SystemExit(f"no raw loop for backend {backend}")


def allreduce_alone(rt, params: int) -> float | None:
    """Median seconds of one allreduce of ``params`` values in the dtype the gradients travel
    in, through the backend's own collective (Horovod's, or torch's group), the slowest rank's:
    what the link and the library's transport take for the gradients with nothing else running.
    None on one node."""
    import torch

    from mpt.backends.ddp import CAST_DTYPES

    if rt.world_size == 1:
        return None
    dtype = CAST_DTYPES.get(rt.config.grad_compression, torch.float32)
    tensor = torch.ones(params, dtype=dtype)
    times = []
    for _ in range(3):
        rt.barrier()
        started = time.perf_counter()
        rt.all_reduce(tensor, op="sum")
        times.append(torch.tensor([time.perf_counter() - started]))
        rt.all_reduce(times[-1], op="max")
    return statistics.median(float(t) for t in times)


def mpt_step(rt, model, loss_fn, x, y) -> None:
    """One training step through mpt, as a user's loop writes it."""
    with rt.autocast():
        loss = loss_fn(model(x), y)
    rt.backward(loss)
    rt.step()


def worker(args: argparse.Namespace) -> None:
    """One rank of a cell: both sides, alternating rounds; rank 0 writes the cell's JSON."""
    import copy

    import torch
    import torch.distributed as dist

    import mpt

    rt = mpt.Runtime(quiet=True)
    base = build_model(args.model)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    params = sum(p.numel() for p in base.parameters())
    twin = None if args.mpt_only else copy.deepcopy(base)
    model, _ = rt.setup(base, torch.optim.SGD(base.parameters(), lr=1e-3, momentum=0.9))
    loss_fn = loss_of(args.model)
    sides = {"mpt": functools.partial(mpt_step, rt, model, loss_fn)}
    if twin is not None:
        sides["raw"] = raw_side(rt.backend.name, twin, rt, loss_fn)
    data = batches(args.model, rt.rank, args.steps)
    times: dict[str, list[float]] = {name: [] for name in sides}
    sent: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.warmup):  # buffers, DeepSpeed's and Horovod's first steps, the heap
        for side in sides.values():
            side(*data[0])
    for round_ in range(args.rounds):
        for name in list(sides)[::1 if round_ % 2 == 0 else -1]:
            rt.barrier()
            before = tx_bytes()
            steps = []
            for x, y in data:
                started = time.perf_counter()
                sides[name](x, y)
                steps.append(time.perf_counter() - started)
            sent[name].append((tx_bytes() - before) / len(data))
            worst = torch.tensor(steps)
            if rt.world_size > 1:  # the job steps at its slowest rank
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times[name] += worst.tolist()
    allreduce = allreduce_alone(rt, params)
    if rt.rank == 0:
        Path(args.worker).write_text(json.dumps({
            "allreduce": allreduce,
            "grad_bytes": grad_bytes, "world_size": rt.world_size,
            "params": params,
            "threads": torch.get_num_threads(),
            **{f"{name}_step": statistics.median(times[name]) for name in times},
            **{f"{name}_tx_per_step": max(sent[name]) for name in sent}}))
    rt.close()


POWERSGD_START = 2
"""``powersgd_start_step`` of a PowerSGD cell (the earliest torch allows): its warm-up steps
(``--warmup``, at least this many) run the plain allreduce, its timed steps PowerSGD."""


def run_cell(model: str, backend: str, compression: str, nodes: int, rate: str,
             args: argparse.Namespace, out: Path) -> dict | None:
    """One job on a fresh emulated cluster; its worker's JSON, or None (with the refusal's line,
    or the nodes' output, printed) when it did not run."""
    from mpt.cluster import EmulatedCluster, LinkShape, launch_command, run_nodes

    name = f"{model} {backend} {compression} {nodes} node(s) {rate}"
    backend_name, *backend_flags = backend.split()  # a backend with flags: a variant of it
    result = out / f"{model}-{'_'.join(backend.split())}-{compression}-{nodes}-{rate}.json"
    result.unlink(missing_ok=True)
    worker_args = ["--worker", str(result), "--model", model, "--steps", str(args.steps),
                   "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                   *(["--mpt-only"] if args.mpt_only else [])]
    flags = ["--host-memory", args.host_memory]
    if args.bucket_mb is not None:
        flags += ["--bucket-mb", str(args.bucket_mb)]
    if compression == "powersgd":  # started within the warm-up: the cell times its own steps
        flags += ["--backend-options", json.dumps({"powersgd_start_step": POWERSGD_START})]
    with EmulatedCluster(nodes=nodes, shape=LinkShape(rate=rate)) as cluster:
        commands = [launch_command(cluster, nr, Path(__file__).resolve(), worker_args,
                                   launch_args=["--backend", backend_name, *backend_flags,
                                                "--grad-compression", compression, *flags])
                    for nr in range(nodes)]
        run = run_nodes(cluster, commands, timeout=args.timeout, cwd=str(ROOT),
                        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if run.nodes[0].exit_code == 2:  # refused before start: the launcher's one line
        print(f"  {name}: {run.nodes[0].output.strip().splitlines()[-1]}", flush=True)
        return None
    if not run.ok or not result.exists():
        print(f"  {name}: failed\n{run.report()[-3000:]}", flush=True)
        return None
    return {"model": model, "backend": backend, "compression": compression, "nodes": nodes,
            "rate": rate, "host_memory": args.host_memory, "seconds": run.seconds,
            **json.loads(result.read_text())}


def rate_bits(rate: str) -> float:
    from mpt.cluster import LinkShape

    return LinkShape(rate=rate).rate_bits()


def analyse(cells: list[dict]) -> list[dict]:
    """Each cell with samples/s, efficiency, the bounds, the overlaps, compressed/uncompressed
    and mpt/raw."""
    from mpt.comm import CASTS

    by = {(c["model"], c["backend"], c["compression"], c["nodes"], c["rate"]): c for c in cells}
    one = {(c["model"], c["backend"]): c for c in cells if c["nodes"] == 1}
    rows = []
    for c in cells:
        n, bits = c["nodes"], rate_bits(c["rate"])
        key = (c["model"], c["backend"], c["compression"], n)
        wire = c["grad_bytes"] // (2 if c["compression"] in CASTS else 1)
        row = {**c, "samples_per_s": n * BATCH / c["mpt_step"],
               "ratio": c["mpt_step"] / c["raw_step"] if "raw_step" in c else None,
               "ring_bound": 2 * (n - 1) / n * wire * 8 / bits,
               "sent_bound": c["mpt_tx_per_step"] * 8 / bits}
        base = one.get((c["model"], c["backend"]))
        if base is not None:
            row["efficiency"] = base["mpt_step"] / c["mpt_step"]  # (N/T_N) / (N x 1/T_1)
        uncompressed = by.get((c["model"], c["backend"], "none", n, c["rate"]))
        if n > 1 and c["compression"] != "none" and uncompressed is not None:
            row["vs_none"] = c["mpt_step"] / uncompressed["mpt_step"]
        if n > 1 and c["rate"] != UNSHAPED:
            if base is not None:  # the issue's: one-node compute against the ring bound
                t_1, t_r = base["mpt_step"], row["ring_bound"]
                row["overlap_issue"] = (t_1 + t_r - c["mpt_step"]) / min(t_1, t_r)
                # ... and its value were the step no longer than the gradients' allreduce alone
                row["overlap_ceiling"] = (t_1 + t_r - c["allreduce"]) / min(t_1, t_r)
            compute = by.get((*key, UNSHAPED))
            if compute is not None:  # compute with the CPU sharing of N nodes, bytes sent
                t_c, t_s = compute["mpt_step"], row["sent_bound"]
                row["overlap"] = (t_c + t_s - c["mpt_step"]) / min(t_c, t_s)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def f(row: dict, key: str, fmt: str) -> str:
        return "" if row.get(key) is None else format(row[key], fmt)

    lines = ["| model | backend | compression | nodes | link | step (s) | samples/s | efficiency "
             "| ring bound (s) | sent/rate (s) | allreduce alone (s) | overlap (issue) | its "
             "ceiling | overlap (CPU-shared) | vs none | mpt/raw |",
             "| --- " * 16 + "|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["backend"], r["compression"],
                                         r["nodes"], rate_bits(r["rate"]))):
        many = r["nodes"] > 1
        link = "unshaped" if r["rate"] == UNSHAPED else r["rate"]
        lines.append(f"| {r['model']} | {r['backend']} | {r['compression'] if many else '-'} | "
                     f"{r['nodes']} | {link if many else '-'} | {r['mpt_step']:.3f} | "
                     f"{r['samples_per_s']:.1f} | {f(r, 'efficiency', '.2f')} | "
                     f"{format(r['ring_bound'], '.3f') if many else ''} | "
                     f"{format(r['sent_bound'], '.3f') if many else ''} | "
                     f"{f(r, 'allreduce', '.3f')} | {f(r, 'overlap_issue', '.2f')} | "
                     f"{f(r, 'overlap_ceiling', '.2f')} | {f(r, 'overlap', '.2f')} | "
                     f"{f(r, 'vs_none', '.3f')} | {f(r, 'ratio', '.3f')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Efficiency against nodes, one line per backend and link, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        lines = sorted({(r["backend"], r["compression"], r["rate"]) for r in rows
                        if r["model"] == model and r["nodes"] > 1})
        for backend, compression, rate in lines:
            points = sorted((r["nodes"], r["efficiency"]) for r in rows
                            if r["model"] == model and r["backend"] == backend and
                            "efficiency" in r and (r["nodes"] == 1 or (
                                r["rate"] == rate and r["compression"] == compression)))
            label = backend + ("" if compression == "none" else f" {compression}")
            if points:  # none without the one-node cell the efficiency is measured against
                ax.plot(*zip(*points, strict=True), marker="o", label=f"{label} {rate}")
        ax.set(title=model, xlabel="nodes", ylabel="scaling efficiency", ylim=(0, 1.1))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def backends(listed: str) -> list[str]:
    """``--backends``' entries: split at each comma that a backend's name follows, so that a
    flag's own commas stay (``deepspeed --offload optimizer,parameters``)."""
    return [b.strip() for b in re.split(r",(?=\s*(?:ddp|apex|horovod|deepspeed|fsdp)\b)",
                                        listed)]


def cell_keys(args: argparse.Namespace) -> list[tuple[str, str, str, int, str]]:
    """(model, backend, compression, nodes, rate) of every cell: one node reduces nothing, so
    it runs once per backend, uncompressed, with no link to shape."""
    return [(model, backend, compression, nodes, rate)
            for model in args.model.split(",") for backend in backends(args.backends)
            for nodes in map(int, args.nodes.split(","))
            for compression in (args.compression.split(",") if nodes > 1 else ["none"])
            for rate in (args.rates.split(",") if nodes > 1 else [UNSHAPED])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set by the driver: rank mode
    parser.add_argument("--models", "--model", dest="model", default="mlp,resnet18")
    parser.add_argument("--backends", default="ddp,apex,horovod,deepspeed,fsdp",
                        help="comma-separated; each a --backend, or one with its flags "
                             "(\"fsdp --fsdp-cpu-offload\"): --mpt-only for those")
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--rates", default=f"1gbit,10gbit,{UNSHAPED}")
    parser.add_argument("--compressions", dest="compression", default="none,bf16",
                        help="--grad-compression values (a backend's refusal skips its cell)")
    parser.add_argument("--bucket-mb", type=float, help="--bucket-mb of every cell (and the "
                        "raw DDP's bucket cap); default: each library's own")
    parser.add_argument("--host-memory", choices=HOST_MEMORY, default=HOST_MEMORY[0],
                        help="--host-memory of every cell (mpt's default: glibc's)")
    parser.add_argument("--mpt-only", action="store_true",
                        help="train mpt's loop alone in each cell's job, no raw twin beside it "
                        "(whose allocations slow mpt's step in the same process: ResNet-18 "
                        "under fsdp at one node 1.3-1.5x); what plan_cluster.py compares the "
                        "plan with")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per cell")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "scaling")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.mpt_only and any(" " in b for b in backends(args.backends)):
        parser.error("--backends: a backend with flags has no raw loop of its own: pass "
                     "--mpt-only")
    from mpt.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"scaling: {reason}")
    if "powersgd" in args.compression.split(",") and args.warmup < POWERSGD_START:
        raise SystemExit(f"scaling: --warmup {args.warmup} would time PowerSGD's plain steps: "
                         f"pass --warmup {POWERSGD_START} or more")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"scaling: {os.cpu_count()} CPU(s) shared by every node, 1 process and 1 thread per "
          f"node, batch {BATCH}/process, fp32, {args.steps} steps x {args.rounds} rounds per "
          "side", flush=True)
    cells = []
    for model, backend, compression, nodes, rate in cell_keys(args):
        cell = run_cell(model, backend, compression, nodes, rate, args, args.out)
        if cell is not None:
            cells.append(cell)
            raw = f", raw {cell['raw_step']:.3f} s" if "raw_step" in cell else ""
            print(f"  {model} {backend} {compression} {nodes} node(s) {rate}: mpt "
                  f"{cell['mpt_step']:.3f} s{raw} ({cell['seconds']:.0f} s)", flush=True)
    rows = analyse(cells)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    plot(rows, args.out / "efficiency.png")
    print(f"results: {args.out / 'results.json'}, plot: {args.out / 'efficiency.png'}")


if __name__ == "__main__":
    sys.exit(main())
