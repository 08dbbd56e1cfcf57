"""Freed host memory goes back to the system (glibc's malloc settings for a training node).

glibc serves a large allocation with its own mmap and, once such a block is freed, raises
its mmap threshold to that block's size (up to 32 MiB), so that later blocks up to that
size come from the heap, whose freed memory it keeps. A node allocates and frees many
whole-tensor temporaries of a few to tens of MiB (the inner optimizer's per-parameter
scratch, the backward's gradients, a checkpoint's staging): with the moving threshold
they stay resident after use, about 24 bytes per parameter at 22M parameters
(benchmarks/real_size.py). A fixed threshold keeps every block above it an mmap of its
own, returned to the system when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
THRESHOLD = 1 << 20  # blocks of 1 MiB and more: mmapped, returned when freed


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 1 MiB (see module doc); False where malloc is not
    glibc's (musl, macOS: nothing to do)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD))
