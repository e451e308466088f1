"""Reading a run directory's metrics files back, also while the run is still writing them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpt.errors import UsageError

_RANK_FILE = re.compile(r"^metrics(?:\.rank(\d+))?\.jsonl$")


@dataclass(kw_only=True, slots=True)
class RankMetrics:
    """One rank's records, as series ready to plot."""

    rank: int
    """The rank that wrote them."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The run's facts from the top of the file (backend, precision, world size)."""
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    """Metric name -> (steps, values); a null value (an inf or NaN when written) is left out."""
    bad_lines: int = 0
    """Lines that are not JSON, other than a half-written last line."""


def read_metrics(path: Path, rank: int) -> RankMetrics:
    """The records in ``path``; a last line without its newline (being written now) is skipped."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if lines and not text.endswith("\n"):
        lines.pop()  # half-written: the writer flushes whole lines, the rest comes later
    out = RankMetrics(rank=rank)
    for line in filter(None, (line.strip() for line in lines)):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            out.bad_lines += 1
            continue
        if not isinstance(record, dict):
            out.bad_lines += 1
        elif "meta" in record:
            out.meta.update(record["meta"])
        elif isinstance(record.get("step"), int):
            for key, value in record.items():
                if key in ("step", "time") or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)):
                    steps, values = out.series.setdefault(key, ([], []))
                    steps.append(record["step"])
                    values.append(float(value))
    return out


def read_run(run_dir: Path) -> list[RankMetrics]:
    """Every rank's metrics in ``run_dir``, rank 0 first."""
    if not run_dir.is_dir():
        raise UsageError("RUN_DIR", str(run_dir), "no such directory",
                         "pass the --run-dir of a run (mpt launch --run-dir DIR ...)")
    found = []
    for path in run_dir.iterdir():
        match = _RANK_FILE.match(path.name)
        if match:
            found.append(read_metrics(path, int(match.group(1) or 0)))
    if not found:
        raise UsageError("RUN_DIR", str(run_dir), "it holds no metrics.jsonl",
                         "pass the --run-dir of a run, or wait until its first record is written")
    return sorted(found, key=lambda m: m.rank)
