"""Child processes that never outlive the process that started them.

Kept free of heavy imports: it runs as a `preexec_fn` (between fork and exec) and the
workspace's test kit uses it for its own children.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Child-side set-up: a process group of its own (a terminal's Ctrl-C reaches only the
    launcher, and the parent can kill the child's whole group) and SIGKILL when the parent
    dies (PR_SET_PDEATHSIG), so no child outlives it."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the process-group kill on exit still applies
        pass
