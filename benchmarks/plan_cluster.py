"""`mpt plan` against steps measured on the emulated cluster: the cells of `benchmarks/scaling.py`.

    .venv/bin/python benchmarks/scaling.py --models mlp --backends ddp,fsdp,deepspeed \
        --nodes 1,2,4 --rates 1gbit,10gbit --compressions none --mpt-only --host-memory steady \
        --out runs/scaling
    .venv/bin/python benchmarks/plan_cluster.py runs/scaling/results.json

The cells run under ``--host-memory steady``, as the plan's launch line on a CPU host runs a
job and as its calibration runs (``mpt.plan.profiles.CPU_HOST_MEMORY``). `scaling.py` measures
each cell as one job of N one-process nodes (network namespaces, each node's
link shaped to the cell's rate) that all share this machine's cores. This script then calibrates
the same way: per (nodes, rate), `mpt plan --calibrate --nodes N --nr R` runs on every node of a
fresh cluster shaped alike, so that the device figures (matmuls by dtype and shape, copy bandwidth,
op overhead, optimizer steps; ``mpt.plan.calibrate``) are measured by N one-thread processes at
once, sharing the cores as the cell's nodes did, and every collective's bus bandwidth and latency
is measured across the nodes; one node's cells are calibrated by 2 processes (the collectives need
two), one of which measures the device, as the cell has one rank. Each calibration is given the
cell's model (`mpt plan benchmarks/plan_cluster.py:MODEL --calibrate`), so every rank also times
that model's own step at the cell's batch per node, which the plan scales its op-by-op compute by.
Each cell is then priced by ``mpt.plan.planner.plan`` on a cluster of N nodes x 1 device of those
figures, linked at the cell's rate (``--link``'s profile: the rate, 5 us a ring step), and again on
the link measured (what `mpt plan --calibration FILE` uses by default). It prints both predictions,
measured (mpt's step, alone in its job with ``--mpt-only``, and the raw library's where
`scaling.py` ran it beside mpt's, the medians it reports) and their ratios,
and, per (model, nodes, rate), whether the layout the plan ranks first among the measured ones
measured within 10 % of the best measured. The goal of issue 36: every ratio within 0.8-1.2, every
best within 10 %. The calibrations run after the cells, never beside them.
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

from mpt.environments.host_memory import HOST_MEMORY
from mpt.plan.profiles import CPU_HOST_MEMORY

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import BATCH, GPT, UNSHAPED, build_model

INPUTS = {"mlp": ([1024], torch.float32), "resnet18": ([3, 32, 32], torch.float32),
          "gpt": ([GPT["block"]], torch.int64)}
"""Each model's input per sample, as ``scaling.batches`` makes it."""
LABELS = {"deepspeed": "--backend deepspeed --zero-stage 1"}
"""The plan's layout of a backend that `scaling.py` runs with its defaults (ZeRO stage 1)."""


def mlp() -> Any:
    return build_model("mlp")


def resnet18() -> Any:
    return build_model("resnet18")


def gpt() -> Any:
    return build_model("gpt")


def calibrate_command(model: str, nodes: int) -> list[str]:
    """`mpt plan MODEL --calibrate` of ``model`` at the cells' batch (``BATCH`` per node)."""
    shape, dtype = INPUTS[model]
    return [sys.executable, "-m", "mpt", "plan", f"{__file__}:{model}", "--calibrate",
            "--input-shape", ",".join(map(str, shape)), "--input-dtype", str(dtype).split(".")[1],
            "--optimizer", "sgd-momentum", "--batch", str(nodes * BATCH)]


def calibrated(model: str, nodes: int, rate: str, folder: Path, reuse: bool) -> Any:
    """`mpt plan MODEL --calibrate` of a cell's model (``run_calibration``), into ``folder``."""
    out = folder / (f"calibration-1-{model}.json" if nodes == 1
                    else f"calibration-{nodes}-{rate}-{model}.json")
    return run_calibration(calibrate_command(model, nodes), nodes, rate, out, reuse)


def run_calibration(command: list[str], nodes: int, rate: str, out: Path, reuse: bool) -> Any:
    """Run `mpt plan ... --calibrate` ``command`` into ``out``: on one node by 2 processes
    (one measures the device); else with ``--nodes N`` on each of ``nodes`` emulated nodes
    shaped at ``rate`` (a fresh cluster shaped as the cell's): the device figures and the
    model's step of N one-thread processes at once, and every collective measured across the
    nodes. ``reuse``: an earlier file, where there is."""
    import subprocess

    from mpt.cluster import EmulatedCluster, LinkShape, run_nodes
    from mpt.plan import calibrate

    if reuse and out.exists():
        return calibrate.load(out)
    out.unlink(missing_ok=True)
    print(f"calibrating: {out.name}, {nodes} node(s)" + (f" at {rate}" if nodes > 1 else ""),
          flush=True)
    command = [*command, "--output", str(out)]
    if nodes == 1:
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return calibrate.load(out)
    with EmulatedCluster(nodes=nodes, shape=LinkShape(rate=rate)) as cluster:
        commands = [[*command, "--nodes", str(nodes), "--nr", str(nr), "--master-addr",
                     cluster.members[0].address] for nr in range(nodes)]
        run = run_nodes(cluster, commands, timeout=900, env={"OMP_NUM_THREADS": "1"})
    if not run.ok or not out.exists():
        raise RuntimeError(f"the calibration failed:\n{run.report()[-3000:]}")
    return calibrate.load(out)


def predicted(cell: dict[str, Any], device: Any, link: Any, step: Any = None) -> Any:
    """The plan's prediction of ``cell``'s layout on nodes linked by ``link`` (None: the
    ``--link`` profile of the cell's rate), its compute scaled by ``step`` (the calibration's
    timing of the model's own step; None: op by op), and its place in the plan's ranking; None
    where the plan has no such layout."""
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
                  optimizer="sgd-momentum", step=step)
    # a backend with flags: those after its label (the plan's order: the stage first)
    name, *flags = cell["backend"].split()
    named = "--zero-stage" in flags or name not in LABELS
    label = " ".join([f"--backend {name}" if named else LABELS[name], *flags])
    if cell["compression"] != "none":
        label += f" --grad-compression {cell['compression']}"
    return next(((p, rank) for rank, p in enumerate(result.fitting) if p.layout.label == label),
                None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="scaling.py's results.json")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the rows as JSON here (default: beside RESULTS)")
    parser.add_argument("--reuse", action="store_true",
                        help="price with the calibration files already beside RESULTS, where "
                        "there are (default: measure each anew)")
    parser.add_argument("--op-by-op", action="store_true",
                        help="price without the model's measured step (the ops alone)")
    args = parser.parse_args()
    cells = [c for c in json.loads(args.results.read_text())
             if c["model"] in INPUTS
             and (c["nodes"] == 1 or c["rate"] != UNSHAPED)]
    other = sorted({c.get("host_memory", HOST_MEMORY[0]) for c in cells} - {CPU_HOST_MEMORY})
    if other:  # the calibration and the plan's launch line run under CPU_HOST_MEMORY
        print(f"note: cells measured under --host-memory {', '.join(other)}, priced as under "
              f"{CPU_HOST_MEMORY}")
    found = {key: calibrated(*key, args.results.parent, args.reuse) for key in sorted(
        {(c["model"], c["nodes"], c["rate"] if c["nodes"] > 1 else UNSHAPED) for c in cells})}
    rows = []
    for cell in sorted(cells, key=lambda c: (c["model"], c["nodes"], c["rate"], c["backend"],
                                             c["compression"])):
        figures = found[cell["model"], cell["nodes"],
                        cell["rate"] if cell["nodes"] > 1 else UNSHAPED]
        device = figures.device(f"{cell['nodes']} node(s)")
        link = figures.measured_link(f"{cell['nodes']} nodes at {cell['rate']}")
        step = None if args.op_by_op else figures.measured_step()
        at = predicted(cell, device, None, step)
        on = at if link is None else predicted(cell, device, link, step)  # one node: no link
        if at is None or on is None:
            print(f"  {cell['model']} {cell['backend']} {cell['compression']} {cell['nodes']}: "
                  "no such layout planned")
            continue
        rows.append({key: cell[key] for key in ("model", "backend", "compression", "nodes",
                                                "rate")} | {
            "mpt": cell["mpt_step"], "raw": cell.get("raw_step"),
            **{how: {"step": p.step, "compute": p.compute, "exposed": p.exposed, "rank": rank}
               for how, (p, rank) in (("at_rate", at), ("on_link", on))}})
    report(rows)
    out = args.out or args.results.parent / "plan_cluster.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"rows: {out}")


def _named(row: dict[str, Any]) -> str:
    """A row's backend, and its compression where it has one."""
    compression = row.get("compression", "none")
    return row["backend"] + ("" if compression == "none" else f" {compression}")


def report(rows: list[dict[str, Any]]) -> None:
    print("| model | backend | compression | nodes | link | predicted at the rate (s) | "
          "predicted, link measured (s): compute + exposed | mpt (s) | predicted / mpt: rate | "
          "measured link | raw (s) |")
    print("| --- " * 11 + "|")
    for r in rows:
        link = r["rate"] if r["nodes"] > 1 else "-"
        at, on = r["at_rate"], r["on_link"]
        print(f"| {r['model']} | {r['backend']} | {r.get('compression', 'none')} | {r['nodes']} "
              f"| {link} | {at['step']:.3f} | "
              f"{on['step']:.3f}: {on['compute']:.3f} + {on['exposed']:.3f} | {r['mpt']:.3f} | "
              f"{at['step'] / r['mpt']:.2f} | **{on['step'] / r['mpt']:.2f}** | "
              f"{'-' if r['raw'] is None else format(r['raw'], '.3f')} |")
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
        chosen = min(group, key=lambda r: r["on_link"]["rank"])  # the plan's first
        best = min(group, key=lambda r: r["mpt"])
        off = chosen["mpt"] / best["mpt"] - 1
        print(f"{model} {nodes} node(s) {rate}: plan's best {_named(chosen)} measured "
              f"{chosen['mpt']:.3f} s, the best measured {_named(best)} {best['mpt']:.3f} s: "
              f"{off * 100:+.1f} % ({'within' if off <= 0.10 else 'over'} 10 %)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
