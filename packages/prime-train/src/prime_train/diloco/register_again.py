"""Registering again, once this node has left or lost its membership: the step a rejoin by
itself (`diloco/rejoin.py`) and a join that lost its place (`diloco/join.py`) share.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prime_mesh import MeshError, MeshRefused
from prime_train.diloco.membership import Membership

if TYPE_CHECKING:
    from prime_train.run import Run

POLL_S = 1.0


class RejoinFailed(MeshError):
    """No coordinator took this node's registration within `diloco.rejoin_wait_s`."""


def register_again(run: Run, error: BaseException) -> Membership:
    """Register again (tries bounded by `diloco.rejoin_wait_s`; `error`: why, for the line if
    it cannot). The coordinator decides, as for a node started afresh: a joiner of the running
    job (`Membership.joining`), or, when the run has no members left, one of the nodes
    forming it anew (the call returns once it formed)."""
    cfg = run.cfg
    deadline = time.monotonic() + cfg.diloco.rejoin_wait_s
    while True:
        try:
            return Membership.join(
                cfg,
                run.ckpt_dir,
                serve=run.primary,
                warn=run.log.warn,
                name=run.placement.node.name,
                launcher_index=run.placement.node.launcher_index,
            )
        except MeshRefused:  # the run completed, or this node cannot take part: said once
            raise
        except (MeshError, OSError) as e:  # the coordinator away or the link flapping
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise RejoinFailed(
                f"this node lost its mesh membership ({type(error).__name__}: {error}) and "
                f"could not register again within diloco.rejoin_wait_s = "
                f"{cfg.diloco.rejoin_wait_s:g} s ({last}); check its link to the coordinator "
                f"at {cfg.mesh.coordinator}, then rerun the same command to join again"
            )
        time.sleep(POLL_S)
