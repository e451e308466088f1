"""Seeing a run: progress on rank 0, metrics.jsonl and TensorBoard files per run directory.

``mpt.Runtime`` feeds a ``Monitor`` from the calls a script already makes (``backward``,
``clip_grad_norm_``, ``step``); ``rt.log(**metrics)`` adds the script's own figures.
`mpt visualize RUN_DIR` draws the files (see ``mpt.visualize``).

The names below are imported when first used: `mpt launch` checks ``--log-every`` with
``mpt.metrics.config`` alone, without the progress bar and the writers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpt.lazy import lazy_attributes

if TYPE_CHECKING:
    from mpt.metrics.config import MetricsConfig
    from mpt.metrics.monitor import Monitor
    from mpt.metrics.reader import RankMetrics, read_metrics, read_run
    from mpt.metrics.writers import metrics_file, tensorboard_dir

_HOMES = {"MetricsConfig": "config", "Monitor": "monitor", "RankMetrics": "reader",
          "read_metrics": "reader", "read_run": "reader", "metrics_file": "writers",
          "tensorboard_dir": "writers"}

__all__ = ["MetricsConfig", "Monitor", "RankMetrics", "metrics_file", "read_metrics", "read_run",
           "tensorboard_dir"]


__getattr__ = lazy_attributes(__name__, _HOMES)
