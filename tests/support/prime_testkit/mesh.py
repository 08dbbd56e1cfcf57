"""prime-mesh's coordinator seen from a test: its nodes' states, and the fake connection and
clock that drive its state machine (`prime_mesh.membership.Membership`) without sockets."""

from __future__ import annotations

from typing import Any


def node_states(coordinator: Any) -> dict[str, str]:
    """Each registered node's state (registering, waiting, joining, member) by node id."""
    return {n["node_id"]: n["state"] for n in coordinator.status()["nodes"]}


class FakeConn:
    """A node's connection as Membership sees it: what it was sent, and whether it was closed."""

    peer = "test:1"

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.closed = False

    def send(self, msg: dict) -> None:
        self.sent.append(msg)

    def close_after_flush(self) -> None:
        self.closed = True

    def replies(self, req: int | None = None) -> list[dict]:
        """The replies sent on it (to request `req` only, when given)."""
        return [m for m in self.sent
                if m.get("type") == "reply" and (req is None or m.get("id") == req)]  # fmt: skip


def form(membership: Any, keys: list[str], sync_timeout: float | None = None) -> dict:
    """Register one single-rank node per key in `membership` (min_nodes = their count) and
    check that they formed epoch 1: {key: (node, its FakeConn)}."""
    nodes = {}
    for k in keys:
        msg: dict[str, Any] = {"node_key": k, "local_rank": 0, "local_world_size": 1,
                               "metadata": {}}  # fmt: skip
        if sync_timeout is not None:
            msg["sync_timeout"] = sync_timeout
        conn = FakeConn()
        nodes[k] = (membership.register(conn, msg), conn)
    assert membership.epoch == 1 and len(membership.members) == len(keys)
    return nodes


class FakeClock:
    """A clock that stands still until the test moves `now`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
