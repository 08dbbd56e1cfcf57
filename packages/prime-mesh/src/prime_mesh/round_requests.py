"""The members' requests the coordinator holds unanswered in one epoch: each local rank's
arrival at the current sync point and its ballot in each commit vote in flight, and the clock
on them (`prime_mesh.barrier.SyncWaits`).

Bookkeeping for `prime_mesh.membership`, which decides what happens: a sync point is answered
once every member's local ranks arrived, a vote once every one voted (True only if all said
ok), and everything held is answered when a new epoch starts. A slot that arrived at its last
sync point `listening` (a joiner that brings nothing yet) is not waited for in a vote: on a
slow link its collective ends after the others', and they must not wait for its transfer; its
ballot counts if it came in time, and a late one is answered with the result decided without
it, even once a later epoch began (a member left meanwhile): every ballot of a decided vote
gets the decided result. A listener stays one across epoch changes until it arrives
contributing.

Each ballot may carry the node's outer step and outer weight hash before the round (`outer`);
a vote also checks that the contributing ballots agree on it: the majority's wins (on a tie,
the group holding the earliest member), and a vote with an odd one out is False for all, so
the others retry without it (`RoundRequests.vote` returns who differs; see
`prime_mesh.membership`). A passed vote's reply carries the contributors' `outer`, for a
listener to check its own against once it caught up. Pure logic, no sockets: answers go out
through `Conn.send` (which queues).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prime_mesh.barrier import SyncWaits
from prime_mesh.node import Conn
from prime_mesh.norms import norm_outliers

Slot = tuple[str, int]  # who sent a request: (node key, local rank)
Outer = tuple[int, str]  # a node's outer step count and outer weight hash
DECIDED_KEPT = 16  # votes whose result a listener's late ballot can still be told


@dataclass
class Ballot:
    """One local rank's ballot in a vote in flight."""

    conn: Conn
    req: int
    ok: bool
    outer: Outer | None  # None: it did not say (a listener, or an older client)


# the start of the eviction reason of a member whose outer weights differ from the others'
DIVERGED = "outer weights differ from the other members'"


@dataclass(frozen=True)
class Odd:
    """A ballot whose outer state differs from the majority's."""

    slot: Slot
    outer: Outer
    majority: Outer
    agreeing: int  # how many contributing ballots hold the majority's
    voting: int  # how many contributing ballots said

    def reason(self) -> str:
        """The eviction reason its node is told (it starts with `DIVERGED`)."""
        (step, mine), (theirs_step, theirs) = self.outer, self.majority
        return (
            f"{DIVERGED} at the vote on outer step {theirs_step + 1}: this node holds outer "
            f"step {step} with hash {mine[:16]}, {self.agreeing} of {self.voting} contributing "
            f"ranks hold outer step {theirs_step} with hash {theirs[:16]}; it rejoins through "
            "live recovery"
        )


def outer_of(msg: dict) -> Outer | None:
    """The `outer` [step, hash] a ballot carries, or None."""
    raw = msg.get("outer")
    if (
        isinstance(raw, (list, tuple))
        and len(raw) == 2
        and isinstance(raw[0], int)
        and isinstance(raw[1], str)
    ):
        return raw[0], raw[1]
    return None


def outer_said(ballots: dict[Slot, Ballot], skip: set[Slot]) -> dict[Slot, Outer]:
    """The outer state each ballot (but those in `skip`: listening) carries, where it does."""
    return {s: b.outer for s, b in ballots.items() if s not in skip and b.outer is not None}


def odd_ones(ballots: dict[Slot, Ballot], skip: set[Slot], order: list[str]) -> list[Odd]:
    """The ballots (but those in `skip`) whose outer state differs from the majority's; a
    tie goes to the group holding the node earliest in `order` (the longest-standing)."""
    said = outer_said(ballots, skip)
    if len(set(said.values())) < 2:
        return []
    groups: dict[Outer, list[Slot]] = {}
    for slot, outer in said.items():
        groups.setdefault(outer, []).append(slot)

    def rank(outer: Outer) -> tuple[int, int]:
        first = min(order.index(k) if k in order else len(order) for k, _ in groups[outer])
        return len(groups[outer]), -first

    majority = max(groups, key=rank)
    agreeing = len(groups[majority])
    return [
        Odd(slot, outer, majority, agreeing, len(said))
        for slot, outer in said.items()
        if outer != majority
    ]


def reply(req: int, **fields: Any) -> dict:
    """The coordinator's answer to request `req`."""
    return {"type": "reply", "id": req, **fields}


class RoundRequests:
    """Sync point arrivals and vote ballots waiting for the other members."""

    def __init__(self) -> None:
        self.arrivals: dict[Slot, tuple[Conn, int, bool, bool]] = {}  # conn, req, admit, failed
        self.ballots: dict[int, dict[Slot, Ballot]] = {}  # by vote seq, this epoch's
        self.waits = SyncWaits()  # how long late members are waited for (see barrier)
        self.listening: set[Slot] = set()  # slots whose last arrival said `listening`
        self.norms2: dict[Slot, float] = {}  # this sync point's stated norms (`prime_mesh.norms`)
        self.norm_bound = 0.0
        # recent votes' results by (epoch, seq), for a listener's late ballot
        self.decided: dict[tuple[int, int], dict] = {}  # a vote's reply fields

    def arrive(self, slot: Slot, conn: Conn, req: int, msg: dict, now: float) -> None:
        """`slot` reached the sync point (`msg`: its sync request)."""
        self.arrivals[slot] = (conn, req, bool(msg.get("admit")), bool(msg.get("failed")))
        norm2 = msg.get("norm2")
        if isinstance(norm2, int | float) and math.isfinite(norm2):
            self.norms2[slot] = float(norm2)
            self.norm_bound = float(msg.get("norm_bound") or 0.0)
        if msg.get("listening"):
            self.listening.add(slot)
        else:  # a listener may come a round early: not its clock
            self.listening.discard(slot)
            self.waits.arrived(now)

    def sync_passed(self, required: set[Slot], now: float) -> tuple[bool, bool] | None:
        """None until every slot in `required` arrived; then (every arrival admits joiners,
        some arrival reports a failed collective), and the sync point's clock stops."""
        # counted first: a full comparison per arrival costs O(members) each
        if len(self.arrivals) < len(required) or not required <= self.arrivals.keys():
            return None
        self.waits.completed(now)
        entries = list(self.arrivals.values())
        return all(a for _, _, a, _ in entries), any(f for _, _, _, f in entries)

    def release(self, epoch_info: dict) -> None:
        """Answer every arrival with `epoch_info` (the epoch they go on in), and each node
        whose stated norm is an outlier with why (`prime_mesh.norms`)."""
        outliers = norm_outliers(self.norms2, self.norm_bound) if self.norms2 else {}
        for slot, (conn, req, _, _) in self.arrivals.items():
            why = outliers.get(slot[0])
            conn.send(reply(req, epoch=epoch_info, **({"outlier": why} if why else {})))
        self.arrivals.clear()
        self.norms2.clear()

    def vote(
        self,
        epoch: int,
        seq: int,
        slot: Slot,
        ballot: Ballot,
        required: set[Slot],
        order: list[str],
        now: float,
    ) -> list[Odd]:
        """`slot`'s ballot in vote `seq` of the current `epoch`; once every slot in `required`
        that is not listening voted, each ballot is answered: True only if every one was ok
        and the contributing ones agree on the outer state. Returns the ballots that did not
        (`odd_ones`; `order`: the members' keys in rank order), for the caller to evict."""
        ballots = self.ballots.setdefault(seq, {})
        ballots[slot] = ballot
        self.waits.voted(seq, now)
        if not set(ballots) >= required - self.listening:
            return []
        odd = odd_ones(ballots, self.listening, order)
        result = not odd and all(b.ok for b in ballots.values())
        # a passed vote tells every ballot the contributors' outer state (one: none differs),
        # so that a listener that has caught up can check its own against it
        said = set(outer_said(ballots, self.listening).values())
        agreed = next(iter(said)) if result and said else None
        decided = {"result": result, **({"outer": list(agreed)} if agreed else {})}
        for b in ballots.values():
            b.conn.send(reply(b.req, **decided))
        del self.ballots[seq]
        self.waits.vote_done(seq)
        self.decided[(epoch, seq)] = decided
        while len(self.decided) > DECIDED_KEPT:
            del self.decided[next(iter(self.decided))]
        return odd

    def overdue(self, now: float, limit: float) -> tuple[str, float, set[Slot]] | None:
        """("sync point" | "vote", seconds waited, the slots that sent theirs) for the oldest
        wait in flight past `limit`, else None."""
        over = self.waits.overdue(now, limit)
        if over is None:
            return None
        what, waited = over
        if what == "sync point":
            return what, waited, set(self.arrivals)
        seq = min(s for s, t in self.waits.vote_since.items() if now - t > limit)
        return what, waited, set(self.ballots.get(seq, {}))

    def new_epoch(self, epoch_info: dict, required: set[Slot]) -> None:
        """Everyone waiting is answered: arrivals with the new epoch, every vote in flight
        False ("the epoch changed"); `required`: the new epoch's slots (a listener among them
        stays one, and the decided results stay for its late ballots)."""
        self.release(epoch_info)
        self.waits.reset()
        self.listening &= required
        for ballots in self.ballots.values():
            for b in ballots.values():
                b.conn.send(reply(b.req, result=False, reason="the epoch changed"))
        self.ballots.clear()
