"""mpt: one PyTorch training script on one CPU, many GPUs or many nodes, in mixed precision,
on the distributed backend chosen by a flag."""

from mpt.environments.world import World
from mpt.errors import MissingDependencyError, MptError, UsageError
from mpt.runtime import Runtime

__version__ = "0.1.0"

__all__ = ["MissingDependencyError", "MptError", "Runtime", "UsageError", "World", "__version__"]
