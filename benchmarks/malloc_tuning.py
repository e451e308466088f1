"""glibc malloc settings shared by the overhead benchmarks (their folder is on sys.path)."""

from __future__ import annotations

import ctypes


def steady_malloc() -> bool:
    """Ask glibc to keep freed memory and to serve big blocks from the heap.

    By default glibc hands large freed blocks back to the OS (munmap, heap trimming) and the next
    step faults the pages in again: here 500-3,000 minor page faults per step, in amounts that
    depend on the allocation history of the whole process, which both sides share. Fixed
    thresholds bring that to about ten per step on both sides. False where this is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's <malloc.h>
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
                and libc.mallopt(m_trim_threshold, 1 << 30))
