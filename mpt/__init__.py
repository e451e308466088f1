"""mpt: one PyTorch training script on one CPU, many GPUs or many nodes, in mixed precision,
on the distributed backend chosen by a flag.

``Runtime``, ``RunConfig`` and ``ParallelPlan`` are imported when first used (``mpt.Runtime``,
``from mpt import Runtime``): the launcher and its worker shim import ``mpt`` without torch's
weight on every process start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpt.environments.world import World
from mpt.errors import MissingDependencyError, MptError, UsageError
from mpt.lazy import lazy_attributes

if TYPE_CHECKING:
    from mpt.parallel import ParallelPlan
    from mpt.parallel.tensor import Split
    from mpt.run_config import RunConfig
    from mpt.runtime import Runtime

__version__ = "0.1.0"
"""The one version source: the wheel's metadata (pyproject.toml) and `mpt --version` read it."""

__all__ = ["MissingDependencyError", "MptError", "ParallelPlan", "RunConfig", "Runtime",
           "Split", "UsageError", "World", "__version__"]


__getattr__ = lazy_attributes(__name__, {"Runtime": "runtime", "RunConfig": "run_config",
                                         "ParallelPlan": "parallel", "Split": "parallel.tensor"})
