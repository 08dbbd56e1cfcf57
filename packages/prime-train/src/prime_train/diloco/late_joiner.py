"""The outer step's side of a join (`diloco/join.py`): a listener's rounds.

A joiner is admitted before its snapshot comes and listens (`diloco/listen.py`): it stays a
member contributing nothing, keeps each committed round and applies none until it has caught
up, at the members' step (the header's `members_step`). The header (`diloco/average.py`)
tells it, at its first round, how many outer steps the members are ahead (`behind`).

With streaming fragments (`diloco/fragments.py`) a listener's round averages the fragment of
the members' count (`Listener.count`), not of its own stale one (`sync_count`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_train.rundir import RunDirError

if TYPE_CHECKING:
    from prime_train.diloco.average import Averaged
    from prime_train.diloco.outer_optimizer import OuterOptimizer
    from prime_train.diloco.outer_step import Diloco


class JoinedLate(RunDirError):
    """A joiner cannot take the members' rounds (its snapshot or the rounds it missed did not
    come, or a round it took part in lacks its update): it leaves and joins again; the
    members go on without waiting."""


def sync_count(outer: Diloco) -> int:
    """The committed count this node's next sync states and takes its fragment from: a
    listener's is the members' (it will have applied their rounds when it enters)."""
    listener = outer.listener
    if listener is not None and listener.count is not None:
        return listener.count
    return outer.outer_steps


def sync_part(outer: Diloco) -> OuterOptimizer:
    """The outer optimizer of the fragment this node's next sync averages (`sync_count`)."""
    return outer.fragments.part(sync_count(outer))


def settle_late(outer: Diloco, got: Averaged, step: int, contributing: bool = True) -> int | None:
    """A committed round `got` ending at inner step `step`: the inner step of the members'
    round, for the round to apply as theirs does (its buffer holding the average); None: a
    round a listener only kept. JoinedLate when it cannot catch up, when the header says
    this node, not listening, lacks rounds the members applied, or when it did not
    contribute (`contributing`: left out of the round) and its outer state is not the
    contributors' (`check_holds_agreed`)."""
    listener = outer.listener
    if listener is None:
        if got.late is not None:
            raise JoinedLate(got.late)  # the members commit; this node leaves
        if not contributing:
            check_holds_agreed(outer)
        return step
    if listener.count is None:  # its first round: its count is 0, or a rejoiner's stale one
        step = (outer.outer_steps + got.behind + 1) * outer.period
        listener.admitted(outer.outer_steps + got.behind)
    if got.members_step is not None:  # the header's: a delayed run's count does not tell it
        step = got.members_step  # (a dropped round moves the step, not the count)
    if not listener.listened(got, step):
        return None  # kept, not applied: it still fetches its snapshot or backlog
    check_holds_agreed(outer)
    outer.listen(None)  # caught up: this round applies as theirs
    return step


def check_holds_agreed(outer: Diloco) -> None:
    """JoinedLate unless this node, which did not contribute to the round just committed (a
    listener that has caught up, a member left out of it), holds the outer state the
    contributors voted with (`mesh.agreed_outer`): its weights are compared only when it
    contributes, and a change made outside the update stream (a fault, a bit flip on the
    only contributor) cannot be replayed from it; applying the round on other weights would
    write a row of another hash; so would applying it at another outer step count (a round
    it missed). The node then takes the members' state again."""
    agreed = outer.mesh.agreed_outer
    if agreed is None:
        return
    if agreed[0] != outer.outer_steps:
        raise JoinedLate(
            f"this node is at outer step {outer.outer_steps}, the contributors at {agreed[0]}: "
            "it missed or repeated a round; it takes the members' state again"
        )
    mine = outer.rounds.node_digest()
    if mine != agreed[1]:
        raise JoinedLate(
            f"outer weights differ from the contributors' at outer step {agreed[0]}: this node "
            f"holds hash {mine[:16]}, the contributors voted with {agreed[1][:16]}; it takes "
            "the members' state again"
        )
