"""Rejoining the running job by itself, after this node lost its membership, without a restart.

A node whose link went down, or that stalled (SIGSTOP, swapping) for longer than the heartbeat
timeout, is evicted: the others go on committing without it. When it comes back, its next mesh
call at an outer boundary raises `MeshEvicted` (the coordinator told it) or `CoordinatorLost`
(its own heartbeats found the coordinator silent while the link was down). Instead of exiting,
the loop's outer boundary (`outer_boundary.py`) takes the path a restarted node takes
(`prime_train.diloco.join`):

1. It closes its old membership (mesh and checkpoint server) and registers again, trying
   for up to `diloco.rejoin_wait_s` until the coordinator takes it.
2. It joins as any node does (`diloco/join.py`): listens while a snapshot of the members
   comes, and enters with their weights, bit for bit (or, when the run has no members left,
   forms it anew with the nodes that come back, from the newest checkpoint any holds).

It does so at most `diloco.max_rejoins` times in one run; one more loss exits 1 with a line
that says so (`RejoinsExhausted`). A node *left out* of a round (late at the sync point past
`diloco.sync_timeout_s`: prime-mesh evicts it with a reason saying so) is bounded apart, by
`diloco.max_missed_rounds` leave-outs in a row (a round it contributed to resets the count;
`LeftOutTooOften`, exit 1), so an honest node that is only sometimes late keeps its place.
The rows it writes carry `rejoined` (the count of all its rejoins).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_mesh import CoordinatorLost, MeshError, MeshEvicted
from prime_train.diloco.join import join_running_job
from prime_train.diloco.listen import JoinedLate
from prime_train.seam import ElasticOuterStep

if TYPE_CHECKING:
    from prime_train.run import Run

# The errors that mean this node is no longer a member and may rejoin (JoinedLate: a round's
# header says it lacks rounds the members applied). CoordinatorGone, a CoordinatorLost whose
# coordinator did not come back within the grace, is handled before these: there is no run
# to rejoin.
MEMBERSHIP_LOST: tuple[type[Exception], ...] = (MeshEvicted, CoordinatorLost, JoinedLate)


# prime-mesh's eviction reason for a member late at a sync point or vote (its membership.py,
# `_leave_out_late`): the one way to tell a leave-out from a cut link or a stall
LEFT_OUT = "left out of the round"


class LeftOutTooOften(MeshError):
    """The node was left out of `diloco.max_missed_rounds` rounds in a row (a mesh error: the
    command line prints it as one line and exits 1)."""


def left_out(error: BaseException) -> bool:
    """Whether `error` is this node's eviction for being late at a sync point."""
    return isinstance(error, MeshEvicted) and LEFT_OUT in str(error)


def check_missed_allowed(run: Run, error: BaseException, missed: int) -> None:
    """LeftOutTooOften when this leave-out makes `missed` in a row reach the bound."""
    allowed = run.cfg.diloco.max_missed_rounds
    if missed >= allowed:
        raise LeftOutTooOften(
            f"this node was left out of {missed} rounds in a row ({error}); "
            f"diloco.max_missed_rounds = {allowed}, so it stops here: it does not reach the "
            "sync point within diloco.sync_timeout_s of the others. Rerun the same command to "
            "join again (or raise diloco.max_missed_rounds or diloco.sync_timeout_s)"
        )


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
    run: Run, outer: ElasticOuterStep, error: BaseException, rejoins: int, bound: int | None = None
) -> int:
    """Steps 1 and 2 of the module doc after `error` ended this node's membership; `rejoins`
    counts this one; `bound`: the count `diloco.max_rejoins` bounds (default `rejoins`; the
    loop leaves leave-outs out of it). Returns the step the node continues from (its entry
    round's)."""
    check_rejoin_allowed(run, error, rejoins if bound is None else bound)
    run.log.warn(
        f"lost the mesh membership ({type(error).__name__}: {error}); rejoining the running "
        f"job through live recovery (rejoin {rejoins}; bounds: diloco.max_rejoins = "
        f"{run.cfg.diloco.max_rejoins} losses, diloco.max_missed_rounds = "
        f"{run.cfg.diloco.max_missed_rounds} leave-outs in a row)"
    )
    return join_running_job(run, outer, lost=error, rejoined=rejoins)
