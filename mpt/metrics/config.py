"""What the runtime records and shows: run directory, progress on or off, how often, which ranks.

Built by the Runtime from its ``RunConfig`` (``run_dir``, ``quiet``, ``log_every``,
``metrics_all_ranks``), where every value was already checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mpt.errors import UsageError


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricsConfig:
    """How a run reports on itself."""

    run_dir: Path | None = None
    """Where metrics.jsonl and the TensorBoard event files go; None writes no files."""
    quiet: bool = False
    """No progress bar or progress lines (files are still written)."""
    log_every: int = 10
    """Optimizer steps between two records. Reading the loss waits for the device, so it is read
    once per record, not once per step."""
    all_ranks: bool = False
    """Every rank writes its own files (metrics.rank<R>.jsonl); otherwise rank 0 only."""


def parse_log_every(value: object) -> int:
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise UsageError("--log-every", value, "it must be a whole number of steps, at least 1",
                         "pass --log-every 10 (larger for very short steps)")
    return number
