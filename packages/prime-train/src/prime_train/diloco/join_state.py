"""What one join holds while it runs (`Joining`) and what it reports once it entered
(`JoinedRow`, the `joined` metrics row): the types the join's three modules (`join.py`,
`listen.py`, `fetch.py`) share, in a module of their own so that none imports another back."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prime_ckpt import SideFileHold
    from prime_train.diloco.fetch import Background


@dataclass
class JoinedRow:
    """The figures of a join, from its first registration to its entry: the members'
    checkpoint of inner step `fetched_step` it loaded, the logged rounds it replayed on top,
    the rounds it listened to. Counts add up over a join's tries."""

    rejoined: int | None = None  # the how-manieth rejoin by itself (None: a fresh join)
    donor: str | None = None  # whose checkpoint (its own state) it loaded
    fetched_step: int = 0
    fetch_bytes: int = 0
    fetch_seconds: float = 0.0
    fetch_held_seconds: float = 0.0  # of those, held while the rounds' all-reduces ran
    fetch_commit_seconds: float = 0.0  # of those, the fsync once it was all in
    snapshot_donors: dict[str, int] = field(default_factory=dict)  # node -> snapshot bytes
    load_seconds: float = 0.0
    snapshots: int = 0  # snapshots loaded (a try that lost its place takes a new one)
    replayed: int = 0  # logged rounds replayed (the backlog: between snapshot and kept rounds)
    replay_bytes: int = 0
    replay_seconds: float = 0.0  # fetching and applying them
    replay_donors: list[str] = field(default_factory=list)
    late_admissions: int = 0  # tries that lost their place and listened again
    listened: int = 0  # rounds taken as a member contributing nothing (`diloco/listen.py`)
    listened_fetching: int = 0  # of the later ones, rounds committed while its backlog came
    snapshot_rounds: int = 0  # rounds listened before the snapshot was in
    backlog_seconds: float = 0.0  # fetching the backlog in the background

    def row(self, step: int, startup: float, admitted: float) -> dict[str, Any]:
        """The metrics row of the entry at inner step `step`; `startup`: seconds from the
        process's start to the join's; `admitted`: from the join's start to its entry."""
        figures = asdict(self)
        rejoined = figures.pop("rejoined")
        return {
            "step": step,
            "joined": True,
            **figures,
            "startup_seconds": startup,
            "admitted_seconds": admitted,
            **({"rejoined": rejoined} if rejoined else {}),
        }


@dataclass
class Joining:
    """One try at joining, live: the figures so far, the inner step of the state it holds,
    and, on the node's local rank 0, the snapshot's fetch under way (`snapshot`) and the hold
    on the donors' update logs (`holder`). `waiting`: no snapshot loaded yet (every local
    rank knows it)."""

    row: JoinedRow
    started: float = field(default_factory=time.monotonic)  # the join's first try
    step: int = 0
    waiting: bool = True
    snapshot: Background | None = None
    holder: SideFileHold | None = None
