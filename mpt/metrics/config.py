"""What the runtime records and shows: run directory, progress on or off, how often, which ranks.

Each setting comes from ``Runtime(...)`` first, then from `mpt launch`'s flags (``MPT_RUN_DIR``,
``MPT_QUIET``, ``MPT_LOG_EVERY``, ``MPT_METRICS_ALL_RANKS``), then from the defaults below.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpt.errors import UsageError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


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

    @classmethod
    def resolve(cls, flags: Mapping[str, Any], *, run_dir: str | os.PathLike[str] | None = None,
                quiet: bool | None = None, log_every: int | None = None,
                all_ranks: bool | None = None) -> MetricsConfig:
        """Arguments given in code win over the launch flags in ``flags`` (strings)."""
        directory = run_dir if run_dir is not None else flags.get("run_dir") or None
        return cls(
            run_dir=Path(directory) if directory is not None else None,
            quiet=quiet if quiet is not None else _flag("--quiet", flags.get("quiet", "")),
            log_every=parse_log_every(log_every if log_every is not None
                                      else flags.get("log_every", 10)),
            all_ranks=(all_ranks if all_ranks is not None
                       else _flag("--metrics-all-ranks", flags.get("metrics_all_ranks", ""))),
        )


def _flag(argument: str, value: str) -> bool:
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise UsageError(argument, value, "it is not a yes/no value", "use 1 or 0")


def parse_log_every(value: object) -> int:
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise UsageError("--log-every", value, "it must be a whole number of steps, at least 1",
                         "pass --log-every 10 (larger for very short steps)")
    return number
