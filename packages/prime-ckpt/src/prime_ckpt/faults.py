"""Named fault points for crash tests.

`PRIME_CKPT_FAULT=point` (or `point@step` or `point@step,step`) SIGKILLs the process when a save reaches that
point (for that step), so tests can prove that a kill at any stage leaves the previous
checkpoint loadable. Points, in the order a save reaches them: stage (half of the tensors
copied to RAM), ram_commit (RAM copy written, not yet marked good), disk_write (half of the
data file on disk), before_manifest, before_rename, after_rename (committed, not pruned),
prune (one old step removed). `enospc` (or `enospc@step`) makes the disk copy fail with
ENOSPC instead, for machines where a small filesystem cannot be mounted.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "PRIME_CKPT_FAULT"
POINTS = (
    "stage",
    "ram_commit",
    "disk_write",
    "before_manifest",
    "before_rename",
    "after_rename",
    "prune",
)


def _at(at: str, step: int) -> bool:
    return not at or step in {int(s) for s in at.split(",")}


def fault(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, at = spec.partition("@")
    if name == point and _at(at, step):
        os.kill(os.getpid(), signal.SIGKILL)


def injected_enospc(step: int) -> None:
    """Raise ENOSPC when `PRIME_CKPT_FAULT=enospc[@step]` asks for it."""
    name, _, at = os.environ.get(ENV, "").partition("@")
    if name == "enospc" and _at(at, step):
        raise OSError(errno.ENOSPC, "No space left on device (injected by PRIME_CKPT_FAULT)")
