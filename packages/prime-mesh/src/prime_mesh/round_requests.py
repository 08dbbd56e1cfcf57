"""The members' requests the coordinator holds unanswered in one epoch: each local rank's
arrival at the current sync point and its ballot in each commit vote in flight, and the clock
on them (`prime_mesh.barrier.SyncWaits`).

Bookkeeping for `prime_mesh.membership`, which decides what happens: a sync point is answered
once every member's local ranks arrived, a vote once every one voted (True only if all said
ok), and everything held is answered when a new epoch starts. A slot that arrived at its last
sync point `listening` (a joiner that brings nothing yet) is not waited for in a vote: on a
slow link its collective ends after the others', and they must not wait for its transfer; its
ballot counts if it came in time, and a late one is answered with the result decided without
it. Pure logic, no sockets: answers go out through `Conn.send` (which queues).
"""

from __future__ import annotations

from typing import Any

from prime_mesh.barrier import SyncWaits
from prime_mesh.node import Conn

Slot = tuple[str, int]  # who sent a request: (node key, local rank)
DECIDED_KEPT = 8  # votes whose result a listener's late ballot can still be told


def reply(req: int, **fields: Any) -> dict:
    """The coordinator's answer to request `req`."""
    return {"type": "reply", "id": req, **fields}


class RoundRequests:
    """Sync point arrivals and vote ballots waiting for the other members."""

    def __init__(self) -> None:
        self.arrivals: dict[Slot, tuple[Conn, int, bool, bool]] = {}  # conn, req, admit, failed
        self.ballots: dict[int, dict[Slot, tuple[Conn, int, bool]]] = {}  # by vote seq
        self.waits = SyncWaits()  # how long late members are waited for (see barrier)
        self.listening: set[Slot] = set()  # slots whose last arrival said `listening`
        self.decided: dict[int, bool] = {}  # recent votes' results, for a listener's late ballot

    def arrive(self, slot: Slot, conn: Conn, req: int, msg: dict, now: float) -> None:
        """`slot` reached the sync point (`msg`: its sync request)."""
        self.arrivals[slot] = (conn, req, bool(msg.get("admit")), bool(msg.get("failed")))
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
        """Answer every arrival with `epoch_info` (the epoch they go on in)."""
        for conn, req, _, _ in self.arrivals.values():
            conn.send(reply(req, epoch=epoch_info))
        self.arrivals.clear()

    def vote(
        self, seq: int, slot: Slot, conn: Conn, req: int, ok: bool, required: set[Slot], now: float
    ) -> None:
        """`slot`'s ballot in vote `seq`; once every slot in `required` that is not listening
        voted, each ballot is answered: True only if every one was ok. A listener's ballot
        after that gets the result decided without it."""
        if seq in self.decided:
            conn.send(reply(req, result=self.decided[seq]))
            return
        ballots = self.ballots.setdefault(seq, {})
        ballots[slot] = (conn, req, ok)
        self.waits.voted(seq, now)
        if len(ballots) + len(self.listening) >= len(required) and (
            required - self.listening <= ballots.keys()
        ):
            result = all(ok for _, _, ok in ballots.values())
            for c, r, _ in ballots.values():
                c.send(reply(r, result=result))
            del self.ballots[seq]
            self.waits.vote_done(seq)
            self.decided[seq] = result
            for old in [s for s in self.decided if s < seq - DECIDED_KEPT]:
                del self.decided[old]

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

    def new_epoch(self, epoch_info: dict) -> None:
        """Everyone waiting is answered: arrivals with the new epoch, every vote in flight
        False ("the epoch changed")."""
        self.release(epoch_info)
        self.waits.reset()
        self.listening.clear()
        self.decided.clear()
        for ballots in self.ballots.values():
            for conn, req, _ in ballots.values():
                conn.send(reply(req, result=False, reason="the epoch changed"))
        self.ballots.clear()
