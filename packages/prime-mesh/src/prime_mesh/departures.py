"""Members departing the run, batched into one epoch change (bookkeeping for `membership`).

Nodes that leave or die close together (10% of a swarm leaving at once) used to cost one
epoch each, and every node rebuilt its group for each. A member's departure waits here
`DEPART_BATCH_S` (the coordinator's window) from the first one of the batch; all of them
then end the epoch together.
Meanwhile the departing members still count in it: no sync point passes and no vote is
decided without them (the new epoch answers those).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prime_mesh.node import Node

log = logging.getLogger("prime_mesh.coordinator")

DEPART_BATCH_S = 0.2  # a crash still ends the epoch this soon
# the eviction of a node joining a run whose every member left (a client may look for it)
ORPHANED = (
    'the run it was joining has no members left; register again (ready "auto"): the nodes '
    "that come back form it anew"
)
# the eviction of every member of a run whose members all arrived at a sync point listening
# (its last contributor left): none holds its state, and no joiner could ever get it from them
STATELESS = (
    "every member of the run was only listening (its last contributor left, none holds its "
    'state); register again (ready "auto"): the nodes form it anew from their newest checkpoints'
)
# the eviction of a node told to found the run at a restarted coordinator before the run's
# members came back to it: the run re-formed from them, and this node is to join it
REFORMED = (
    "the run re-formed from its members after a coordinator restart; register again (ready "
    '"auto"): this node joins it'
)


class Departures:
    def __init__(self, clock: Callable[[], float], window: float) -> None:
        self.clock, self.window = clock, window
        self._batch: dict[str, tuple[Node, str]] = {}  # by node key: (node, reason)
        self._due: float | None = None

    def __bool__(self) -> bool:
        return bool(self._batch)

    def add(self, node: Node, reason: str) -> None:
        """`node` departs for `reason` (its first reason is kept)."""
        self._batch.setdefault(node.key, (node, reason))
        if self._due is None:
            self._due = self.clock() + self.window

    def take(self, due_only: bool = True) -> list[tuple[Node, str]]:
        """The batch (emptied), once it is due (`due_only`) or at once."""
        if self._due is None or (due_only and self.clock() < self._due):
            return []
        batch = list(self._batch.values())
        self._batch.clear()
        self._due = None
        return batch


def log_departure(node: Node, reason: str) -> None:
    """The coordinator's log line for a node that departs (as it departs, batched or not)."""
    level = logging.INFO if reason == "left gracefully" else logging.WARNING
    log.log(level, "%s evicted: %s", node.node_id, reason)
