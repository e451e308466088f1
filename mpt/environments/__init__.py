"""The environment part of mpt: who this process is in the job, and where it was told so.

``World`` holds the rank maths; ``detect_world(os.environ)`` reads it from the launcher or
cluster that started the process (torchrun, SLURM, horovodrun, OpenMPI, Kubernetes PyTorchJob).
"""

from mpt.environments.detect import SOURCES, detect_world, first_host
from mpt.environments.world import World, device_name

__all__ = ["SOURCES", "World", "detect_world", "device_name", "first_host"]
