"""How much memory this rank holds: the CUDA caching allocator's figures, or the process RSS."""

from __future__ import annotations

import functools
import resource
import sys

import psutil
import torch

_MIB = 2**20


def memory_metrics(device: torch.device) -> dict[str, float]:
    """``memory_mib`` (now) and ``memory_peak_mib`` (since start) for ``device``.

    On a GPU these are the tensors allocated on it (what an out-of-memory error is about); on a
    CPU, the resident set of the whole process (tensors, Python, libraries).
    """
    if device.type == "cuda":
        return {"memory_mib": torch.cuda.memory_allocated(device) / _MIB,
                "memory_peak_mib": torch.cuda.max_memory_allocated(device) / _MIB}
    rss = _this_process().memory_info().rss
    # The kernel updates the peak lazily: it can read a little below the current figure.
    return {"memory_mib": rss / _MIB, "memory_peak_mib": max(rss, _peak_rss_bytes()) / _MIB}


@functools.cache
def _this_process() -> psutil.Process:
    return psutil.Process()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS says bytes, Linux KiB
