"""Registering again as a joiner, once this node has left or lost its membership: the step a
rejoin by itself (`diloco/rejoin.py`) and a joiner admitted late (`diloco/join.py`) share.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from prime_mesh import MeshError
from prime_train.diloco.membership import Membership, count_live_members

if TYPE_CHECKING:
    from prime_train.run import Run

POLL_S = 1.0


class RejoinFailed(MeshError):
    """No coordinator with live members answered within `diloco.rejoin_wait_s`."""


def _live_members(run: Run, token: str | None) -> int:
    """The run's live members as the node's local rank 0 sees them (its ranks agree)."""
    placement = run.placement
    live = [count_live_members(run.cfg.mesh.coordinator, token) if run.primary else 0]
    if placement.world_size > 1:
        dist.broadcast_object_list(live, src=0, group=placement.group)
    return int(live[0])


def register_again(run: Run, error: BaseException) -> Membership:
    """Wait (bounded) for a coordinator with live members, then register as a joiner
    (`error`: why this node registers again, for the line if it cannot)."""
    cfg = run.cfg
    token = cfg.mesh.token.get_secret_value() if cfg.mesh.token else None
    deadline = time.monotonic() + cfg.diloco.rejoin_wait_s
    last = "no answer yet"
    while True:
        live = _live_members(run, token)
        if live > 0:
            try:
                return Membership.join(
                    cfg,
                    run.ckpt_dir,
                    serve=run.primary,
                    warn=run.log.warn,
                    live_members=live,
                    name=run.placement.node.name,
                    launcher_index=run.placement.node.launcher_index,
                )
            except (MeshError, OSError) as e:  # the link flapped again: keep trying
                last = f"{type(e).__name__}: {e}"
        else:
            last = "the coordinator did not answer or the run has no live member"
        if time.monotonic() > deadline:
            raise RejoinFailed(
                f"this node lost its mesh membership ({type(error).__name__}: {error}) and "
                f"could not rejoin within diloco.rejoin_wait_s = {cfg.diloco.rejoin_wait_s:g} s "
                f"({last}); check its link to the coordinator at {cfg.mesh.coordinator}, then "
                "rerun the same command to join again"
            )
        time.sleep(POLL_S)
