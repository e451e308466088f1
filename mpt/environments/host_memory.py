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
  A block of 32 MiB or more is mapped anew at every allocation and faulted in at every step.
- ``lean``: glibc's own starting mmap threshold, 128 KiB, kept from rising, and a trim
  threshold of twice that (glibc's ratio), what ``MALLOC_MMAP_THRESHOLD_=131072`` in a worker's
  environment does, chosen per run instead: every freed block of 128 KiB or more leaves at
  once, so resident memory tracks what the run holds, and each step faults its blocks in again
  (CPU training on 2 cores: 1.0-2.7 x the step time; docs/benchmarks.md). A threshold of 1 MiB
  left blocks just under it in the heaps, which freed around blocks still held cannot trim: a
  pipeline's last stage at 16 micro-batches of 128 rows (outputs of 512 KiB) grew by 12 MiB a
  step, 45 MiB over 6 steps.
- ``steady``: freed blocks are kept and reused, whatever their size, as a GPU's caching
  allocator keeps its blocks: after the first steps a step faults nothing in again and resident
  memory stays at its high-water mark. Where the machine has jemalloc (Debian's
  ``libjemalloc2``), the launcher preloads it into the workers with its decay off
  (``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1``: freed pages are never purged), as
  torch's own CPU launcher (``torch.backends.xeon.run_cpu --enable-jemalloc``) does: its size
  classes serve a freed block to the next request of its size (measured: DeepSpeed ZeRO-1 on
  2 ranks of a 25 M-parameter MLP faulted nothing in from its third step on, at a flat 1.39
  GiB for 30 steps, against 0.97-1.0 GiB under ``fast``). Elsewhere (no jemalloc, or a process
  not started by ``mpt launch``) glibc's heaps keep every block (``mallopt``: at most 0 mmap'd
  blocks, trim threshold -1), which settles more slowly and at more memory: torch asks for
  64-byte aligned blocks, which glibc serves from a free region a little larger than the block,
  so a freed block can fall short of the next request and the heap grows until two merge (a
  64 MiB block allocated and freed in turn: 3-8 rounds, 192-448 MiB faulted in, in 40 runs);
  that DeepSpeed job grew to 2.0 GiB in 14 steps and 2.1 GiB at step 72 of 100, and still
  faulted in 96 MiB a step (a block too large for a thread's own heap, about 64 MiB outside the
  main thread, is still mapped). The run says once when it falls back.

The launcher sets what must be in place before a worker starts (``host_memory_env``); in the
process, ``mpt.connector.connect`` applies the rest once (``apply_host_memory``), before the
Runtime allocates anything of the model. Other C libraries (musl, macOS) have no ``mallopt`` to
call: there ``lean`` and glibc's ``steady`` have no effect and the run says so once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Mapping

from mpt.parse import one_of

HOST_MEMORY = ("fast", "lean", "steady")
"""The choices of ``--host-memory``; the first is the default."""

parse_host_memory = one_of(*HOST_MEMORY)

LEAN_MMAP_THRESHOLD = 128 << 10
"""Blocks of this many bytes and more get their own mapping, returned to the OS when freed
(glibc's ``DEFAULT_MMAP_THRESHOLD_MIN``, where its threshold starts)."""
LEAN_TRIM_THRESHOLD = 2 * LEAN_MMAP_THRESHOLD
"""Free space above this at the top of a heap goes back to the OS (glibc's ratio to the mmap
threshold)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # from glibc's <malloc.h>

SETTINGS = {"lean": ((_M_MMAP_THRESHOLD, LEAN_MMAP_THRESHOLD),
                     (_M_TRIM_THRESHOLD, LEAN_TRIM_THRESHOLD)),
            "steady": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))}
"""Each mode's ``mallopt`` calls on glibc, in order; ``fast`` makes none (``steady``'s: where
jemalloc is not preloaded). Setting either threshold stops glibc moving both; a trim threshold
of -1 turns trimming off and an mmap maximum of 0 maps no block (``man mallopt``)."""

JEMALLOC = "jemalloc"
"""The library ``steady`` preloads where the dynamic linker finds it (``libjemalloc.so.2``)."""
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""jemalloc's settings under ``steady``: freed pages are never purged, so they stay for reuse
(a user's own ``MALLOC_CONF`` follows and wins)."""


def host_memory_env(mode: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment needs before it starts for ``mode``, given the launcher's
    ``environ``: under ``steady``, jemalloc preloaded with its decay off where this machine has
    it; nothing for the other modes, whose settings the process applies itself."""
    library = ctypes.util.find_library(JEMALLOC) if mode == "steady" else None
    if library is None:
        return {}
    preload = environ.get("LD_PRELOAD", "").split()
    conf = environ.get("MALLOC_CONF", "")
    return {"LD_PRELOAD": " ".join([library, *(p for p in preload if p != library)]),
            "MALLOC_CONF": f"{JEMALLOC_CONF},{conf}" if conf else JEMALLOC_CONF}


def _glibc() -> ctypes.CDLL | None:
    """The glibc this process runs on, None where its C library is another."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def on_jemalloc() -> bool:
    """Whether this process's ``malloc`` is jemalloc's (preloaded: its ``mallctl`` is global)."""
    return hasattr(ctypes.CDLL(None), "mallctl")


def apply_host_memory(mode: str) -> str | None:
    """Set this process's allocator for ``mode`` (one of ``HOST_MEMORY``); a line to tell the
    user where it cannot, or where ``steady`` falls back to glibc (None where it took effect
    or where nothing was to change)."""
    mode = parse_host_memory("--host-memory", mode)
    if mode == "fast":
        return None  # glibc's default: nothing to set
    if on_jemalloc():
        return None if mode == "steady" else (
            f"mpt: --host-memory {mode} has no effect here: this process's allocator is "
            "jemalloc (LD_PRELOAD), whose settings are its MALLOC_CONF")
    libc = _glibc()
    if libc is None:
        return (f"mpt: --host-memory {mode} has no effect here: the C library is not glibc, "
                "and its allocator keeps its own defaults")
    if not all(libc.mallopt(param, value) for param, value in SETTINGS[mode]):
        return f"mpt: --host-memory {mode} has no effect here: glibc's mallopt refused it"
    if mode == "steady":
        return ("mpt: --host-memory steady keeps blocks in glibc's heaps here, not jemalloc's "
                "(its resident set can settle at twice fast's): install libjemalloc2 and start "
                "the job with mpt launch")
    return None
