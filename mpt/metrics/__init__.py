"""Seeing a run: progress on rank 0, metrics.jsonl and TensorBoard files per run directory.

``mpt.Runtime`` feeds a ``Monitor`` from the calls a script already makes (``backward``,
``clip_grad_norm_``, ``step``); ``rt.log(**metrics)`` adds the script's own figures.
`mpt visualize RUN_DIR` draws the files (see ``mpt.visualize``).
"""

from mpt.metrics.config import MetricsConfig
from mpt.metrics.monitor import Monitor
from mpt.metrics.reader import RankMetrics, read_metrics, read_run
from mpt.metrics.writers import metrics_file, tensorboard_dir

__all__ = ["MetricsConfig", "Monitor", "RankMetrics", "metrics_file", "read_metrics", "read_run",
           "tensorboard_dir"]
