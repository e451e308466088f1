"""`mpt plan` against steps measured on the emulated cluster: the cells of `benchmarks/scaling.py`.

    .venv/bin/python benchmarks/scaling.py --models mlp --backends ddp,fsdp,deepspeed \
        --nodes 1,2,4 --rates 1gbit,10gbit --compressions none --out runs/scaling
    .venv/bin/python benchmarks/plan_cluster.py runs/scaling/results.json

`scaling.py` measures each cell as one job of N one-process nodes (network namespaces, each
node's link shaped to the cell's rate) that all share this machine's cores. This script then
calibrates the machine the same way, once per node count: max(N, 2) processes of one thread
each measure at once what `mpt plan --calibrate` measures (``mpt.plan.calibrate``: matmuls by
dtype and shape, copy bandwidth, op overhead, optimizer steps; collectives between them), so
that the figures share the cores as the cell's N nodes did; rank 0's are kept. Each cell is
then priced by ``mpt.plan.planner.plan`` on a cluster of N nodes x 1 device of those figures,
linked at the cell's rate (``--link``'s profile: the rate, 5 us a ring step), and again on the
link measured: per (nodes, rate), the same sweep of collectives run across the emulated nodes
themselves (an `mpt launch` job on a fresh cluster shaped alike), each collective's bus
bandwidth and latency given to the plan. It prints both predictions, measured (mpt's step and
the raw library's, the medians `scaling.py` reports) and their ratios, and, per (model, nodes,
rate), whether the layout the plan ranks first among the measured ones measured within 10 % of
the best measured. The goal of issue 36: every ratio within 0.8-1.2, every best within 10 %.
The calibrations run after the cells, never beside them.
A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import BATCH, UNSHAPED, build_model

INPUTS = {"mlp": ([1024], torch.float32), "resnet18": ([3, 32, 32], torch.float32)}
"""Each model's input per sample, as ``scaling.batches`` makes it."""
LABELS = {"deepspeed": "--backend deepspeed --zero-stage 1"}
"""The plan's layout of a backend that `scaling.py` runs with its defaults (ZeRO stage 1)."""


def sweep_worker(out: str) -> None:
    """One node's rank of the link's sweep (started by `mpt launch` on each emulated node):
    ``mpt.plan.calibrate.sweep`` between the nodes; rank 0 writes the fits to ``out``."""
    import mpt
    from mpt.plan import calibrate

    rt = mpt.Runtime()
    fits = calibrate.sweep(rt.world_size, torch.device("cpu"), lambda: None)
    if rt.rank == 0:
        Path(out).write_text(json.dumps(fits))
    rt.close()


def measured_link(nodes: int, rate: str, folder: Path) -> Any:
    """The link of ``nodes`` emulated nodes shaped at ``rate``, each collective measured across
    them (the sweep `mpt plan --calibrate` runs between a machine's ranks) as a ``Link``."""
    from mpt.cluster import EmulatedCluster, LinkShape, launch_command, run_nodes
    from mpt.plan.profiles import CollectiveFit, Link

    out = folder / f"link-{nodes}-{rate}.json"
    out.unlink(missing_ok=True)
    with EmulatedCluster(nodes=nodes, shape=LinkShape(rate=rate)) as cluster:
        commands = [launch_command(cluster, nr, Path(__file__).resolve(), ["--sweep", str(out)])
                    for nr in range(nodes)]
        run = run_nodes(cluster, commands, timeout=600, env={"OMP_NUM_THREADS": "1"})
    if not run.ok or not out.exists():
        raise RuntimeError(f"the link's sweep failed:\n{run.report()[-3000:]}")
    fits = {name: CollectiveFit(**fit) for name, fit in json.loads(out.read_text()).items()}
    ring = fits["all_reduce"]
    return Link(name=f"{rate}, measured", bandwidth=ring.bus_bandwidth, latency=ring.latency,
                source=str(out), collectives=fits)


def predicted(cell: dict[str, Any], device: Any, link: Any) -> Any:
    """The plan's prediction of ``cell``'s layout on nodes linked by ``link`` (None: the
    ``--link`` profile of the cell's rate), or None where the plan has no such layout."""
    from mpt.estimate import meta_model
    from mpt.plan.network import Cluster
    from mpt.plan.planner import plan
    from mpt.plan.profiles import link_profile

    nodes = cell["nodes"]
    rate = cell["rate"] if nodes > 1 else "100gbit"  # one node: no link is crossed
    cluster = Cluster(nodes=nodes, gpus=1, device=device, link=link or link_profile(rate))
    shape, dtype = INPUTS[cell["model"]]
    result = plan(meta_model(lambda: build_model(cell["model"])), cluster, precision="fp32",
                  batch=nodes * BATCH, input_shape=shape, input_dtype=dtype,
                  optimizer="sgd-momentum")
    label = LABELS.get(cell["backend"], f"--backend {cell['backend']}")
    return next((p for p in result.fitting if p.layout.label == label), None)


def main() -> None:
    from mpt.plan import calibrate

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="?", help="scaling.py's results.json")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the rows as JSON here (default: beside RESULTS)")
    parser.add_argument("--sweep", metavar="OUT", help=argparse.SUPPRESS)  # a node's rank
    args = parser.parse_args()
    if args.sweep:
        sweep_worker(args.sweep)
        return
    if args.results is None:
        parser.error("pass scaling.py's results.json")
    cells = [c for c in json.loads(args.results.read_text())
             if c["compression"] == "none" and c["model"] in INPUTS
             and (c["nodes"] == 1 or c["rate"] != UNSHAPED)]
    by_processes = {}
    for processes in sorted({max(c["nodes"], 2) for c in cells}):
        print(f"calibrating: {processes} processes at once", flush=True)
        found = calibrate.measure(processes)  # what `mpt plan --calibrate` measures
        calibrate.save(found, args.results.parent / f"calibration-{processes}.json")
        by_processes[processes] = found.device(f"{processes} processes")
    devices = {c["nodes"]: by_processes[max(c["nodes"], 2)] for c in cells}
    links = {}
    for nodes, rate in sorted({(c["nodes"], c["rate"]) for c in cells if c["nodes"] > 1}):
        print(f"measuring the link: {nodes} nodes at {rate}", flush=True)
        links[nodes, rate] = measured_link(nodes, rate, args.results.parent)
    rows = []
    for cell in sorted(cells, key=lambda c: (c["model"], c["nodes"], c["rate"], c["backend"])):
        device, link = devices[cell["nodes"]], links.get((cell["nodes"], cell["rate"]))
        at = predicted(cell, device, None)
        on = at if link is None else predicted(cell, device, link)  # one node: no link
        if at is None or on is None:
            print(f"  {cell['model']} {cell['backend']} {cell['nodes']}: no such layout planned")
            continue
        rows.append({key: cell[key] for key in ("model", "backend", "nodes", "rate")} | {
            "mpt": cell["mpt_step"], "raw": cell["raw_step"],
            **{how: {"step": p.step, "compute": p.compute, "exposed": p.exposed}
               for how, p in (("at_rate", at), ("on_link", on))}})
    report(rows)
    out = args.out or args.results.parent / "plan_cluster.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"rows: {out}")


def report(rows: list[dict[str, Any]]) -> None:
    print("| model | backend | nodes | link | predicted at the rate (s) | predicted, link measured "
          "(s): compute + exposed | mpt (s) | predicted / mpt: rate | measured link | raw (s) |")
    print("| --- " * 10 + "|")
    for r in rows:
        link = r["rate"] if r["nodes"] > 1 else "-"
        at, on = r["at_rate"], r["on_link"]
        print(f"| {r['model']} | {r['backend']} | {r['nodes']} | {link} | {at['step']:.3f} | "
              f"{on['step']:.3f}: {on['compute']:.3f} + {on['exposed']:.3f} | {r['mpt']:.3f} | "
              f"{at['step'] / r['mpt']:.2f} | **{on['step'] / r['mpt']:.2f}** | {r['raw']:.3f} |")
    for how in ("at_rate", "on_link"):
        ratios = [r[how]["step"] / r["mpt"] for r in rows]
        if ratios:
            inside = sum(0.8 <= x <= 1.2 for x in ratios)
            print(f"predicted ({how}) / mpt: {min(ratios):.2f}-{max(ratios):.2f}; {inside} of "
                  f"{len(ratios)} within +-20 %")
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["nodes"], r["rate"]), []).append(r)
    for (model, nodes, rate), group in sorted(groups.items()):
        if len(group) < 2:
            continue
        chosen = min(group, key=lambda r: r["on_link"]["step"])
        best = min(group, key=lambda r: r["mpt"])
        off = chosen["mpt"] / best["mpt"] - 1
        print(f"{model} {nodes} node(s) {rate}: plan's best {chosen['backend']} measured "
              f"{chosen['mpt']:.3f} s, the best measured {best['backend']} {best['mpt']:.3f} s: "
              f"{off * 100:+.1f} % ({'within' if off <= 0.10 else 'over'} 10 %)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
