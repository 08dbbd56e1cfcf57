"""A joiner's committed rounds before it is even with the members: the outer step's side of
joining late (`diloco/join.py`).

A joiner admitted late (the members committed rounds after the state it loaded) or before its
snapshot came learns it from the round's header (`diloco/average.py`: `late`, `behind`).
DiLoCo with data slots, synchronous or delayed, listens (`diloco/listen.py`, the outer step's
`listen_late`): it stays a member contributing nothing, keeps each committed round and applies
none until it has caught up, at the members' step (the header's `members_step`). Otherwise
(`late_catch_up`) it replays the rounds it missed in place, or leaves with `JoinedLate`.

With streaming fragments (`diloco/fragments.py`) a listener's round averages the fragment of
the members' count (`Listener.count`), not of its own stale one (`sync_count`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from prime_train.rundir import RunDirError

if TYPE_CHECKING:
    from prime_train.diloco.average import Averaged
    from prime_train.diloco.fragments import Fragments
    from prime_train.diloco.outer_optimizer import OuterOptimizer


class Diloco(Protocol):
    """What joining late needs of the outer step (`diloco/outer_step.py`'s `Diloco`, which
    imports this module: named here by its shape, not imported back)."""

    listener: Any  # the `diloco/listen.py` Listener while it listens
    listen_first: bool
    listen_late: Callable[[int, int], Any] | None
    late_catch_up: Callable[[int, int], bool] | None
    fragments: Fragments
    period: int

    @property
    def outer_steps(self) -> int: ...


class JoinedLate(RunDirError):
    """A joiner was admitted at a later outer step than the state it loaded: its weights
    would differ from the members', so it leaves (the members go on without waiting)."""


def sync_count(outer: Diloco) -> int:
    """The committed count this node's next sync states and takes its fragment from: a
    listener's is the members' (it will have applied their rounds when it enters)."""
    return outer.listener.count if outer.listener is not None else outer.outer_steps


def sync_part(outer: Diloco) -> OuterOptimizer:
    """The outer optimizer of the fragment this node's next sync averages (`sync_count`)."""
    return outer.fragments.part(sync_count(outer))


def settle_late(outer: Diloco, got: Averaged, step: int) -> int | None:
    """A committed round `got` ending at inner step `step`, on a node that may be a late
    joiner or a listener: the inner step of the members' round, for the round to apply as
    theirs does (its buffer holding the average); None: a round it only listened to (kept,
    not applied). JoinedLate when it cannot catch up."""
    late = got.late is not None or outer.listen_first
    if outer.listener is None and late and outer.listen_late:
        if outer.listen_first:  # its count is 0, or a rejoiner's stale one
            step = (outer.outer_steps + got.behind + 1) * outer.period
        else:  # from the state it loaded: the members' round
            step += got.behind * outer.period
        outer.listen_first = False
        outer.listener = outer.listen_late(outer.outer_steps, got.behind)
    if outer.listener is not None:  # (its buffer holds the round's average)
        if got.members_step is not None:  # the header's: a delayed run's count does not
            step = got.members_step  # tell it (a dropped round moves the step, not the count)
        if not outer.listener.listened(got, step):
            return None  # kept, not applied: it still fetches its backlog
        outer.listener = None  # caught up: this round applies as theirs
    elif got.late is not None:
        if not catch_up_in_place(outer, got.behind):
            raise JoinedLate(got.late)  # the members commit; this node leaves
        step += got.behind * outer.period  # the members' round
    return step


def catch_up_in_place(outer: Diloco, behind: int) -> bool:
    """A joiner admitted `behind` rounds late: replay the updates the members applied since
    its state (`late_catch_up`), then this round's average applies as theirs does. False
    (nothing usable: it leaves) when it cannot."""
    if outer.late_catch_up is None or behind <= 0:
        return False
    mine = outer.outer_steps
    members = outer.fragments.part(mine + behind)  # the fragment the members averaged
    average = members.pseudo_gradient.clone()  # the replay reuses the buffer
    if not outer.late_catch_up(mine, mine + behind):
        return False
    members.pseudo_gradient.copy_(average)
    return True
