"""`mpt visualize RUN_DIR`: a run's metrics as PNG plots and one self-contained HTML page.

It reads the run's metrics*.jsonl files (one per rank that recorded), also while the run is
still writing them, and draws one plot per metric with a line per rank. The HTML page embeds
the images (base64), so it can be mailed or attached to a ticket as one file.
"""

from __future__ import annotations

import base64
import html
import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpt.errors import MissingDependencyError, UsageError
from mpt.metrics.reader import RankMetrics, read_run

LABELS = {
    "loss": "loss (mean over the steps since the last record)",
    "lr": "learning rate (first param group)",
    "loss_scale": "loss scale",
    "skipped_steps": "skipped steps (non-finite gradients), cumulative",
    "grad_norm": "gradient norm before clipping",
    "samples_per_s": "samples / s (all ranks)",
    "step_time_s": "step time (s)",
    "memory_mib": "memory (MiB): GPU allocated, or process RSS on CPU; dashed: peak",
}
COMPANIONS = {"memory_mib": "memory_peak_mib"}
"""Metrics drawn dashed in another one's plot rather than in their own."""
RESIZE = ("resize_world", "resize_from", "resize_time_lost_s")
"""An elastic job's resize record (mpt.elastic): a marked step on every plot, no plot of its
own."""
"""The built-in metrics, in the order they are drawn; the script's own (rt.log) come after."""


def metric_names(ranks: list[RankMetrics]) -> list[str]:
    present = ({name for rank in ranks for name in rank.series} - set(COMPANIONS.values())
               - set(RESIZE))
    return [n for n in LABELS if n in present] + sorted(present - set(LABELS))


def _figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError("mpt visualize", "matplotlib", "pip install matplotlib",
                                     str(exc)) from exc
    # A bare Figure draws with Agg and touches no pyplot global state: no display is needed.
    return Figure(figsize=(7, 3.6), dpi=110, layout="constrained")


def plot_metric(name: str, ranks: list[RankMetrics]) -> bytes:
    """One metric, a line per rank, as PNG bytes."""
    fig = _figure()
    ax = fig.add_subplot()
    values_seen: list[float] = []
    for rank in ranks:
        if name not in rank.series:
            continue
        steps, values = rank.series[name]
        values_seen += values
        line, = ax.plot(steps, values, label=f"rank {rank.rank}", linewidth=1.4,
                        marker="o" if len(steps) < 30 else None, markersize=3)
        if COMPANIONS.get(name) in rank.series:
            ax.plot(*rank.series[COMPANIONS[name]], linestyle="--", linewidth=1,
                    color=line.get_color())
    resizes = {step: world for rank in ranks
               for step, world in zip(*rank.series.get("resize_world", ([], [])), strict=True)}
    for step, world in sorted(resizes.items()):
        ax.axvline(step, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"{world:g} proc.", (step, 1), xycoords=("data", "axes fraction"),
                    fontsize=7, color="grey", ha="left", va="top")
    positive = [v for v in values_seen if v > 0]
    if name in ("loss", "loss_scale", "grad_norm") and len(positive) == len(values_seen) \
            and positive and max(positive) / min(positive) > 50:
        ax.set_yscale("log")  # a loss falling over decades is flat on a linear axis
    ax.set_title(LABELS.get(name, name), fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.grid(True, alpha=0.3)
    if len(ranks) > 1:
        ax.legend(fontsize=8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    """Written whole, then renamed: a browser reloading during --watch never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def render(run_dir: Path, out_dir: Path, *, refresh: float | None = None) -> list[Path]:
    """Draw every metric of ``run_dir`` into ``out_dir``; the files written, index.html last."""
    ranks = read_run(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, images = [], []
    for name in metric_names(ranks):
        png = plot_metric(name, ranks)
        path = out_dir / f"{name}.png"
        _write_atomic(path, png)
        written.append(path)
        images.append((name, png))
    page = out_dir / "index.html"
    _write_atomic(page, _html(run_dir, ranks, images, refresh).encode())
    return [*written, page]


def _html(run_dir: Path, ranks: list[RankMetrics], images: list[tuple[str, bytes]],
          refresh: float | None) -> str:
    meta = ranks[0].meta
    facts = ", ".join(f"{k} {meta[k]}" for k in ("backend", "precision", "world_size",
                                                 "accumulate") if k in meta)
    rows = []
    for rank in ranks:
        last = {name: values[-1] for name, (_, values) in rank.series.items()}
        step = max((steps[-1] for steps, _ in rank.series.values()), default=0)
        cells = "".join(f"<td>{last[n]:.4g}</td>" if n in last else "<td></td>"
                        for n in metric_names(ranks))
        bad = f" ({rank.bad_lines} unreadable lines)" if rank.bad_lines else ""
        rows.append(f"<tr><td>rank {rank.rank}{bad}</td><td>{step}</td>{cells}</tr>")
    header = "".join(f"<th>{html.escape(n)}</th>" for n in metric_names(ranks))
    figures = "".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}"></figure>' for name, png in images)
    reload = f'<meta http-equiv="refresh" content="{refresh:g}">' if refresh else ""
    title = html.escape(f"mpt run {run_dir.absolute().name}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8">{reload}<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin-bottom: 1em; }}
td, th {{ border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: right; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 0.5em; }}
figure {{ margin: 0; }} img {{ max-width: 100%; width: 770px; }}
</style></head><body>
<h1>{title}</h1>
<p>{html.escape(str(run_dir.absolute()))}: {html.escape(facts)}. Drawn
{time.strftime("%Y-%m-%d %H:%M:%S")}; latest values below.</p>
<table><tr><th></th><th>step</th>{header}</tr>{"".join(rows)}</table>
<div class="grid">{figures}</div>
</body></html>
"""


def _state(run_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when a rank writes a record: the metrics files' sizes and times."""
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                        for p in run_dir.glob("metrics*.jsonl")))


def command(run_dir: Path, out_dir: Path | None, *, watch: bool, interval: str,
            say: Callable[[str], object]) -> None:
    """The body of `mpt visualize`: draw once, or with ``watch`` again whenever the run wrote."""
    try:
        seconds = float(interval)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UsageError("--interval", interval, "it must be a number of seconds above 0",
                         "pass --interval 10")
    out = out_dir or run_dir / "plots"
    if not watch:
        written = render(run_dir, out)
        say(f"mpt: wrote {len(written) - 1} plots and {written[-1]}")
        return
    if not run_dir.is_dir():
        read_run(run_dir)  # its error says what a run directory is
    say(f"mpt: drawing {run_dir} into {out} every {seconds:g} s while it changes; Ctrl-C stops")
    seen: tuple[tuple[str, int, int], ...] = ()
    try:
        while True:
            state = _state(run_dir)
            if state and state != seen:
                written = render(run_dir, out, refresh=seconds)
                seen = state
                say(f"mpt: {time.strftime('%H:%M:%S')} redrew {len(written) - 1} plots, "
                    f"{written[-1]}")
            time.sleep(seconds)
    except KeyboardInterrupt:
        say("mpt: stopped watching")
