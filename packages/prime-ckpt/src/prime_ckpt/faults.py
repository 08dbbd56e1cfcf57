"""Named fault points for crash tests.

`PRIME_CKPT_FAULT=point` (or `point@step`) SIGKILLs the process when a save reaches that
point (for that step), so tests can prove that a kill at any stage leaves the previous
checkpoint loadable. Points, in the order a save reaches them: stage (half of the tensors
copied to RAM), ram_commit (RAM copy written, not yet marked good), disk_write (half of the
data file on disk), before_manifest, before_rename, after_rename (committed, not pruned),
prune (one old step removed).
"""

from __future__ import annotations

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


def fault(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, at = spec.partition("@")
    if name == point and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)
