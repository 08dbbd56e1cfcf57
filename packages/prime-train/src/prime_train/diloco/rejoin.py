"""Rejoining the running job by itself, after this node lost its membership, without a restart.

A node whose link went down, or that stalled (SIGSTOP, swapping) for longer than the heartbeat
timeout, is evicted: the others go on committing without it. When it comes back, its next mesh
call at an outer boundary raises `MeshEvicted` (the coordinator told it) or `CoordinatorLost`
(its own heartbeats found the coordinator silent while the link was down). Instead of exiting,
the loop's outer boundary (`diloco/boundary.py`) takes the path a restarted node takes
(`prime_train.diloco.join`):

1. It closes its old membership (mesh and checkpoint server) and waits, up to
   `diloco.rejoin_wait_s`, until the coordinator answers and the run has live members.
2. It registers again as a joiner (waiting), fetches a member's fresh boundary checkpoint,
   loads it (outer weights, momentum, data position), and takes the zero-contribution entry
   step: from then on its weights are the members', bit for bit.

It does so at most `diloco.max_rejoins` times in one run; one more loss exits 1 with a line
that says so (`RejoinsExhausted`). The rows it writes carry `rejoined` (the count).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prime_mesh import CoordinatorLost, MeshError, MeshEvicted
from prime_train.diloco.join import enter_running_job, load_members_state
from prime_train.diloco.register_again import register_again
from prime_train.seam import ElasticOuterStep

if TYPE_CHECKING:
    from prime_train.run import Run

# The mesh errors that mean this node is no longer a member and may rejoin. (CoordinatorGone,
# a CoordinatorLost whose coordinator did not come back within the grace, is handled before
# these: there is no run to rejoin.)
MEMBERSHIP_LOST: tuple[type[MeshError], ...] = (MeshEvicted, CoordinatorLost)


class RejoinsExhausted(MeshError):
    """The node lost its membership more often than `diloco.max_rejoins` allows (a mesh
    error: the command line prints it as one line and exits 1)."""


def check_rejoin_allowed(run: Run, error: BaseException, rejoins: int) -> None:
    """RejoinsExhausted when `rejoins` (this one included) exceeds `diloco.max_rejoins`."""
    allowed = run.cfg.diloco.max_rejoins
    if rejoins > allowed:
        raise RejoinsExhausted(
            f"this node lost its mesh membership {rejoins} times ({type(error).__name__}: "
            f"{error}); diloco.max_rejoins = {allowed} rejoins are allowed in one run, so it "
            "stops here. Check its link to the others, then rerun the same command to join "
            "again (or raise diloco.max_rejoins)"
        )


def rejoin_running_job(
    run: Run, outer: ElasticOuterStep, error: BaseException, rejoins: int
) -> int:
    """Steps 1 and 2 of the module doc after `error` ended this node's membership; `rejoins`
    counts this one. Returns the step the node continues from (its entry round's)."""
    check_rejoin_allowed(run, error, rejoins)
    placement = run.placement
    run.log.warn(
        f"lost the mesh membership ({type(error).__name__}: {error}); rejoining the running "
        f"job through live recovery (rejoin {rejoins} of at most {run.cfg.diloco.max_rejoins})"
    )
    assert placement.membership is not None
    try:
        placement.membership.close()
    except Exception as e:  # an evicted node's connection is already gone: nothing to leave
        run.log.info(f"closing the old membership: {type(e).__name__}: {e}")
    t0 = time.monotonic()
    membership = register_again(run, error)
    placement.membership = membership
    outer.reattach(membership.mesh)
    run.log.info(
        f"registered again as {membership.mesh.node_id} after "
        f"{time.monotonic() - t0:.1f} s ({membership.members_seen} member(s)): fetching their state"
    )
    record = load_members_state(run, outer, rejoined=rejoins)
    return enter_running_job(run, outer, record)
