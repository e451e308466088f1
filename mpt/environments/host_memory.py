"""How this process's C allocator treats freed host memory (``--host-memory``).

glibc's malloc serves a block of at least its mmap threshold with its own ``mmap`` and returns it
to the OS when freed; smaller ones come from its heaps, which keep freed space for reuse. The
threshold starts at 128 KiB and rises to the size of each mmap'd block freed, up to 32 MiB. A
sharded job frees blocks of many MiB every step (FSDP's per-unit gathers, gradients), so after a
few steps they all come from fragmented heaps and resident memory grows to several times what the
run holds (measured: a 100.7 M-parameter MLP on 4 fsdp ranks, a share of 384 MiB per rank, grew
by 2.2 GiB in 6 steps).

- ``fast``: glibc's defaults. Freed blocks below the mmap threshold stay in its heaps for reuse,
  except what lies free at the top of a heap beyond its trim threshold (twice the mmap
  threshold): that goes back to the OS, and the next step that needs it faults it in again. When
  that happens depends on the order of the heap's blocks (measured: fsdp's ResNet-18 at one rank
  faults 38-45 MB of a 44.7 MB model back in at every backward, ddp's at some runs' steps).
- ``lean``: a fixed mmap threshold of 1 MiB and a trim threshold of 2 MiB (glibc's own ratio),
  what ``MALLOC_MMAP_THRESHOLD_=1048576`` in a worker's environment does (the same peak on the
  MLP above: +650 MiB over the RSS before ``mpt.Runtime``), chosen per run instead: every freed
  block of 1 MiB or more leaves at once, so resident memory tracks what the run holds, and each
  step faults its large blocks in again (CPU training on 2 cores: 1.5-1.9 x the CPU time of a
  step, 1.84 x its wall time on a quiet machine; docs/benchmarks.md).
- ``steady``: glibc's defaults as they settle after the first steps, held from the start and
  never trimmed: an mmap threshold fixed at 32 MiB (glibc's ceiling for its moving one) and no
  heap trimming. A step reuses the heap's blocks that an earlier one freed instead of faulting
  them in again; a block of 32 MiB or more is mapped and faulted in anew, as under ``fast``,
  unless a free region of the heap holds it. Resident memory stays at its high-water mark
  (measured against ``fast``: peaks 0.96-1.13 x, steps 0.73-1.07 x, ResNet-18's under fsdp
  0.73 x and under DeepSpeed 0.81 x; docs/parallel.md).

Applied once per process by ``mpt.connector.connect``, before the Runtime allocates anything of
the model. Other C libraries (musl, macOS) have no ``mallopt`` to call: there the setting has no
effect and the run says so once.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from mpt.parse import one_of

HOST_MEMORY = ("fast", "lean", "steady")
"""The choices of ``--host-memory``; the first is the default."""

parse_host_memory = one_of(*HOST_MEMORY)

LEAN_MMAP_THRESHOLD = 1 << 20
"""Blocks of this many bytes and more get their own mapping, returned to the OS when freed."""
LEAN_TRIM_THRESHOLD = 2 * LEAN_MMAP_THRESHOLD
"""Free space above this at the top of a heap goes back to the OS (glibc's ratio to the mmap
threshold)."""

STEADY_MMAP_THRESHOLD = 32 << 20
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts: the highest its moving threshold goes."""
NO_TRIM = -1
"""A trim threshold of -1 turns heap trimming off (``man mallopt``)."""

THRESHOLDS = {"lean": (LEAN_MMAP_THRESHOLD, LEAN_TRIM_THRESHOLD),
              "steady": (STEADY_MMAP_THRESHOLD, NO_TRIM)}
"""Each mode's (mmap threshold, trim threshold) in bytes; ``fast`` sets none."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's <malloc.h>


def _glibc() -> ctypes.CDLL | None:
    """The glibc this process runs on, None where its C library is another."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def apply_host_memory(mode: str) -> str | None:
    """Set this process's allocator for ``mode`` (one of ``HOST_MEMORY``); a line to tell the
    user where it cannot (None where it took effect or where nothing was to change)."""
    mode = parse_host_memory("--host-memory", mode)
    if mode == "fast":
        return None  # glibc's default: nothing to set
    libc = _glibc()
    if libc is None:
        return (f"mpt: --host-memory {mode} has no effect here: the C library is not glibc, "
                "and its allocator keeps its own defaults")
    # The mmap threshold first: setting it fixes both thresholds (glibc stops moving them).
    mmap_threshold, trim_threshold = THRESHOLDS[mode]
    if not (libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
            and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)):
        return f"mpt: --host-memory {mode} has no effect here: glibc's mallopt refused it"
    return None
