"""Start writing received bytes to disk while the transfer goes on, so that the fsync before
a fetched checkpoint's commit finds little left to write (it took a quarter of a capped
transfer's time when the disk sat idle until the end).

Linux's `sync_file_range(SYNC_FILE_RANGE_WRITE)` queues the range for writeback and returns
at once; it is no durability promise (the commit's fsync still gives that). Elsewhere, or
where libc lacks it, this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_SYNC_FILE_RANGE_WRITE = 2


def _load():
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Queue bytes [offset, offset + length) of `fd` for writing to disk; never blocks long,
    never raises (best effort)."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
