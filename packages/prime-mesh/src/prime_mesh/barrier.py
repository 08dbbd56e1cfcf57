"""How long the coordinator waits for late members at a sync point or a vote.

Heartbeats only reveal a node that stopped (crashed, SIGSTOPped, cut off). A node that is stuck
while its heartbeat thread goes on (its training thread blocked on a read, a wedged driver, a
fault hook) would hold every other member at the sync point for good. So once the first member
reaches a sync point (or casts a round's vote), the others have `SyncWaits.limit()` seconds to
follow; the membership then evicts those that did not (left out of the round: the others go on
without them, and a trainer rejoins through live recovery, see prime_train.diloco.rejoin).

The limit is the largest `sync_timeout` a member registered with. A member that registered
none (None or 0: auto) asks for AUTO_FACTOR x the largest arrival spread (first to last member)
of the last AUTO_WINDOW sync points that completed, clamped to [AUTO_FLOOR_S, AUTO_CEILING_S].
Why those numbers: a node left out costs a whole-state fetch and a round of zero contribution,
far more than waiting; the noise that makes an honest node late (GC, a checkpoint staging,
scheduling on a shared machine, a slower GPU) is seconds, and a persistently slower node shows
in the spread, so it is tolerated up to four times its usual lateness. A stuck node costs the
others at most the limit, once. Sync points that ran out are not recorded (their spread is the
limit itself, and the limit would feed on its own value).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

AUTO_FLOOR_S = 30.0
AUTO_FACTOR = 4.0
AUTO_CEILING_S = 600.0
AUTO_WINDOW = 8


def checked_sync_timeout(value: float | None) -> float | None:
    """A registration's `sync_timeout`: None (auto) for None or 0, else seconds > 0
    (ValueError otherwise)."""
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e6:
        raise ValueError(f"sync_timeout must be None (auto) or seconds > 0, got {value!r}")
    return float(value)


def request_bound(
    sync_timeout: float | None, heartbeat_timeout: float, heartbeat_interval: float
) -> float:
    """How long a node waits for the coordinator's answer to a sync point or vote: the
    longest the coordinator may wait for late members (its auto ceiling, or more if asked),
    plus a heartbeat timeout for the answer to arrive. Past it the coordinator heartbeats
    but does not answer: a bug, raised as MeshTimeout rather than waited on."""
    return max(sync_timeout or 0.0, AUTO_CEILING_S) + heartbeat_timeout + 2 * heartbeat_interval


class SyncWaits:
    """The coordinator's clock on one run's sync points and votes (pure bookkeeping: the
    membership asks who is late and evicts them)."""

    def __init__(self) -> None:
        self.spreads: deque[float] = deque(maxlen=AUTO_WINDOW)
        self.barrier_since: float | None = None  # first arrival at the current sync point
        self.vote_since: dict[int, float] = {}  # first ballot of each vote in flight

    def auto(self) -> float:
        """The auto limit from the recent arrival spreads (see module doc)."""
        spread = max(self.spreads, default=0.0)
        return min(AUTO_CEILING_S, max(AUTO_FLOOR_S, AUTO_FACTOR * spread))

    def limit(self, asked: Iterable[float | None]) -> float:
        """Seconds the current members are waited for: the largest any of them asked for
        (`asked`: each member's `sync_timeout`, None for auto)."""
        values = [self.auto() if a is None else a for a in asked]
        return max(values, default=self.auto())

    def arrived(self, now: float) -> None:
        """A member reached the sync point (the first one starts the clock)."""
        if self.barrier_since is None:
            self.barrier_since = now

    def completed(self, now: float) -> None:
        """Every member reached the sync point: record its spread, stop the clock."""
        if self.barrier_since is not None:
            self.spreads.append(now - self.barrier_since)
        self.barrier_since = None

    def voted(self, seq: int, now: float) -> None:
        self.vote_since.setdefault(seq, now)

    def vote_done(self, seq: int) -> None:
        self.vote_since.pop(seq, None)

    def reset(self) -> None:
        """A new epoch answered everyone waiting: no sync point or vote is in flight."""
        self.barrier_since = None
        self.vote_since.clear()

    def overdue(self, now: float, limit: float) -> tuple[str, float] | None:
        """("sync point" | "vote", seconds waited) when the oldest wait in flight has run
        past `limit`, else None."""
        waits = []
        if self.barrier_since is not None:
            waits.append(("sync point", now - self.barrier_since))
        waits += [("vote", now - t) for t in self.vote_since.values()]
        over = [w for w in waits if w[1] > limit]
        return max(over, key=lambda w: w[1]) if over else None
