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


class FakeClock:
    """A clock that stands still until the test moves `now`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
