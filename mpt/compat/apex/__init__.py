"""``apex.amp`` and ``apex.parallel`` on native torch, for code written against NVIDIA Apex.

Upstream Apex removed both in 2025. Legacy code changes only its imports::

    from mpt.compat.apex import amp                      # was: from apex import amp
    from mpt.compat.apex.parallel import DistributedDataParallel as DDP
"""

from mpt.compat.apex import amp, parallel

__all__ = ["amp", "parallel"]
