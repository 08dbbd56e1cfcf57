"""Read-only views of the coordinator's `Membership`: the epoch it hands out, each node's
state, the status that `prime-mesh status` prints and the status page's data.

`MembershipViews` is a base class of `Membership` (in `prime_mesh.membership`, the state
machine that changes what these read), split out to keep that module short. It reads only
the public state declared here.
"""

from __future__ import annotations

from collections.abc import Callable

from prime_mesh.node import Node
from prime_mesh.progress import History, page_of
from prime_mesh.round_requests import RoundRequests


class MembershipViews:
    """What the coordinator tells nodes and the status page about the run (see `Membership`)."""

    min_nodes: int
    clock: Callable[[], float]
    epoch: int
    prefix: str
    joined: list[str]  # node ids admitted at the sync point that made this epoch
    members: list[str]  # node keys, in rank order
    nodes: dict[str, Node]
    joiners: list[str]  # complete, ready nodes, admitted at the next sync point
    history: History
    completed: str | None  # config hash of a run whose members finished it
    pending: RoundRequests  # sync point arrivals and votes in flight

    def epoch_info(self) -> dict:
        return {
            "epoch": self.epoch,
            "prefix": self.prefix,
            "members": [self.nodes[k].node_id for k in self.members],
            "joined": self.joined,
            **({"checkpoint": newest} if (newest := self._newest_checkpoint()) else {}),
        }

    def _newest_checkpoint(self) -> tuple[int, str] | None:
        """The newest checkpoint a node of the members' run reported (a coordinator may
        outlive a run and host another)."""
        newest = self.history.newest_checkpoint
        if newest is None or not self.members:
            return None
        run = self.nodes[self.members[0]].metadata.get("config_hash")
        return newest[:2] if newest[2] == run else None

    def state_of(self, node: Node) -> str:
        """registering, waiting, joining or member (see `prime_mesh.membership`)."""
        if node.member:
            return "member"
        if node.key in self.joiners:
            return "joining"
        return "waiting" if node.complete else "registering"

    def status(self) -> dict:
        now = self.clock()
        listening = {key for key, _ in self.pending.listening}

        def view(node: Node) -> dict:
            ages = [now - t for t in node.last_seen.values()]
            return {
                "node_id": node.node_id,
                "rank": self.members.index(node.key) if node.member else None,
                "state": self.state_of(node),
                # a member whose last sync point it reached listening: it holds no state yet
                "listening": node.member and node.key in listening,
                "local_world_size": node.local_world_size,
                "last_heartbeat_age": max(ages) if ages else None,
                "metadata": node.metadata,
            }

        ordered = self.members + [k for k in self.nodes if k not in self.members]
        return {
            "epoch": self.epoch,
            "min_nodes": self.min_nodes,
            "nodes": [view(self.nodes[k]) for k in ordered],
            "completed": self.completed is not None and not self.members,
        }

    def page(self) -> dict:
        """The status page's data (see `prime_mesh.progress.page_of`)."""
        addresses = {n.node_id: n.address for n in self.nodes.values()}
        members = [self.nodes[k].node_id for k in self.members]
        return page_of(self.history, self.status(), addresses, members)

    def running(self) -> bool:
        """Whether the run has members, or reconnected nodes are re-forming it."""
        return bool(self.members) or any(n.resume is not None for n in self.nodes.values())

    def run_node(self, exclude: str) -> Node | None:
        """A node of the run, whose settings a registering node must fit (not `exclude`)."""
        if self.members:
            return self.nodes[self.members[0]]
        return next((n for k, n in self.nodes.items() if k != exclude), None)
