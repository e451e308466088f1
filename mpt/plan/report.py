"""`mpt plan`'s output: a table for people, JSON for tools."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from mpt.plan.cost import Prediction
from mpt.plan.planner import Plan, launch_line
from mpt.plan.profiles import CPU_HOST_MEMORY

GIB = 2.0**30
MB = 1e6


def _source(result: Plan) -> str:
    device, link = result.cluster.device, result.cluster.link
    made = "datasheet" if device.source == "datasheet" else f"calibrated ({device.source})"
    return (f"device {device.name}: {made}; node link {link.name}: {link.source}"
            + ("; datasheet peaks: a lower bound of the step" if device.source == "datasheet"
               else "") + f"; compute: {result.compute}"
            + (f"; memory: what a rank holds, which the resident set under --host-memory "
               f"{CPU_HOST_MEMORY} exceeds by the freed blocks its allocator keeps; where "
               "memory is short, launch with --host-memory lean, whose resident set these "
               "figures describe (docs/plan.md)" if device.device_type == "cpu" else ""))


def as_json(result: Plan, script: str) -> dict[str, Any]:
    """Every figure, in seconds and bytes."""
    return {
        "cluster": {"nodes": result.cluster.nodes, "gpus": result.cluster.gpus,
                    "device": result.cluster.device.name, "link": result.cluster.link.name,
                    "source": _source(result)},
        "parameters": result.parameters, "batch": result.batch, "precision": result.precision,
        "best": None if not result.fitting else launch_line(
            result.best, result.cluster, script, result.batch, result.precision),
        "fitting": [_entry(p) for p in result.fitting],
        "not_fitting": [_entry(p) for p in result.short],
        "refused": [{"flags": " ".join(r.flags), "reason": r.reason} for r in result.refused],
    }


def _entry(p: Prediction) -> dict[str, Any]:
    m = p.memory
    return {"layout": p.layout.label, "mesh": p.layout.plan.describe(),
            "microbatches": p.layout.microbatches, "micro_batch": p.layout.micro_batch,
            "memory": {"parameters": m.row.parameters, "gradients": m.row.gradients,
                       "optimizer": m.row.optimizer, "activations": m.activations,
                       "buffers": m.buffers, "buffers_after_backward": m.between,
                       "optimizer_step_temporaries": m.transient,
                       "total": p.total_memory, "capacity": p.capacity,
                       "host": p.memory.row.host, "host_capacity": p.host_capacity,
                       "short": p.short},
            "step_s": p.step, "compute_s": p.compute, "exposed_comm_s": p.exposed,
            "hidden_comm_s": p.hidden, "bubble_s": p.bubble, "terms_s": dict(p.terms),
            "link_bytes": p.link_bytes, "rank_bytes": p.rank_bytes, "limiter": p.limiter}


SHORT = {"--backend ": "", "--pipeline-stages ": "P=", "--pipeline-schedule ": "",
         "--microbatches ": "M=", "--tensor-parallel ": "T=", "--grad-compression ": "",
         "--accumulate ": "A="}
"""How the table writes a layout's flags (it is wide): the backend, a schedule and a
compression by their names, P, M, T and A by their letters (``LEGEND``)."""
LEGEND = ("P: --pipeline-stages, M: --microbatches, T: --tensor-parallel, A: --accumulate; a "
          "--pipeline-schedule (1f1b where none) and a --grad-compression by their names")


def _short(label: str) -> str:
    """A layout's flags as the table writes them (``SHORT``)."""
    for flag, short in SHORT.items():
        label = label.replace(flag, short)
    return label


def _first(rows: tuple[Prediction, ...], top: int) -> tuple[Prediction, ...]:
    """The first ``top`` rows (0: all)."""
    return rows[:top] if top else rows


def _left_out(console: Console, count: int, top: int, which: str) -> None:
    """A line saying how many of ``count`` rows a table of ``top`` leaves out."""
    if top and count > top:
        console.print(f"the {top} {which} of {count} layouts; --top 0 shows all, --json lists "
                      "each")


def print_tables(result: Plan, script: str, console: Console, top: int = 0) -> None:
    """The ranking, the layouts that do not fit, and the best layout's launch line; each table
    cut at ``top`` rows (0: every row), saying how many it leaves out."""
    cluster = result.cluster
    table = Table(title=f"{result.parameters:,} parameters on {cluster.nodes} x {cluster.gpus}"
                  f" ranks, global batch {result.batch}, {result.precision}; {_source(result)}",
                  caption=LEGEND)
    for column in ("layout", "memory/rank GiB", "step ms", "compute", "exposed comm",
                   "bubble", "samples/s", "MB/link/step", "limited by"):
        table.add_column(column, justify="left" if column in ("layout", "limited by")
                         else "right", no_wrap=column in ("layout", "limited by"))
    for p in _first(result.fitting, top):
        table.add_row(_short(p.layout.label), f"{p.total_memory / GIB:.2f}", f"{p.step * 1e3:.1f}",
                      f"{p.compute * 1e3:.1f}", f"{p.exposed * 1e3:.1f}",
                      f"{p.bubble * 1e3:.1f}", f"{result.batch / p.step:,.0f}",
                      f"{p.link_bytes / MB:.1f}", p.limiter)
    console.print(table)
    _left_out(console, len(result.fitting), top, "fastest")
    if result.short:
        host = 0.0 if cluster.device.shares_host_memory else cluster.device.host_memory
        lacking = Table(title=f"layouts that do not fit in {cluster.device.memory / GIB:.1f} "
                        "GiB per rank" + (f", or whose offloaded state does not in the host's "
                                          f"{host / GIB:.1f} GiB per rank" if host else ""))
        for column in ("layout", "needs GiB/rank", "offloaded GiB/rank", "short GiB"):
            lacking.add_column(column, justify="left" if column == "layout" else "right")
        for p in _first(result.short, top):
            lacking.add_row(_short(p.layout.label), f"{p.total_memory / GIB:.2f}",
                            f"{p.memory.row.host / GIB:.2f}", f"{p.short / GIB:.2f}")
        console.print(lacking)
        _left_out(console, len(result.short), top, "closest to fitting")
    console.print(f"{len(result.refused)} other combinations are refused by mpt (--json lists "
                  "each with its reason). Not counted in memory: the allocator's slack, the "
                  "process (a few hundred MiB), the target batch, DeepSpeed ZeRO-0's buffers.")
    if any(p.layout.comm.compression == "powersgd" for p in result.fitting):
        console.print("--grad-compression powersgd is priced once it has started (--backend-"
                      "options powersgd_start_step, 1000 by default; the plain allreduce "
                      "before); on a CPU host its measured steps ran 1.1-2.4 x the priced ones, "
                      "the first writes of its per-bucket copies among what is not priced "
                      "(docs/plan.md).")
    if result.fitting:
        console.print("best: " + launch_line(result.best, cluster, script, result.batch,
                                             result.precision), markup=False)
