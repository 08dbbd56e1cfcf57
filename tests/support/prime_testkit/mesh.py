"""prime-mesh's coordinator seen from a test: its nodes' states and ids, one round of mesh node
processes (`mesh_round`), and the fake connection and clock that drive its state machine
(`prime_mesh.membership.Membership`) without sockets (`form`, `register`)."""

from __future__ import annotations

from typing import Any


def node_states(coordinator: Any) -> dict[str, str]:
    """Each registered node's state (registering, waiting, joining, member) by node id."""
    return {n["node_id"]: n["state"] for n in coordinator.status()["nodes"]}


def node_ids(coordinator: Any) -> list[str]:
    """The registered nodes' ids, in the order the coordinator's status lists them."""
    return [n["node_id"] for n in coordinator.status()["nodes"]]


def mesh_round(
    cluster: Any, values: dict[str, float], timeout: float, check_mean: bool = False
) -> tuple[dict[str, dict], dict[str, dict]]:
    """One README-loop step on the mesh nodes named in `values` (a `Nodes` of prime-mesh's
    tests/mesh_node.py): sync point, all-reduce of each one's value, vote (which must pass);
    with `check_mean`, every node's mean must be the values' mean before the vote. Each node's
    reinit and ok reports; every report is waited for at most `timeout` seconds."""
    names = list(values)
    cluster.send(names, "reinit")
    reinit = {n: cluster.expect(n, "reinit", timeout=timeout) for n in names}
    for n in names:
        cluster.send(n, "allreduce", value=values[n])
    ok = {n: cluster.expect(n, "ok", timeout=timeout) for n in names}
    if check_mean:
        assert {o["mean"] for o in ok.values()} == {sum(values.values()) / len(values)}
    cluster.send(names, "vote", ok=True)
    assert {cluster.expect(n, "vote", timeout=timeout)["result"] for n in names} == {True}
    return reinit, ok


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


def register(
    membership: Any,
    key: str,
    lr: int = 0,
    lws: int = 1,
    ready: bool | str | None = None,
    cfg: str | None = None,
) -> tuple[Any, FakeConn]:
    """Register rank `lr` of `lws` of node `key` in `membership` over a new FakeConn, with
    metadata {"k": key} (and "config_hash": `cfg` when given), and "ready" when given: (the
    node, its FakeConn)."""
    metadata = {"k": key} if cfg is None else {"k": key, "config_hash": cfg}
    msg: dict[str, Any] = {"node_key": key, "local_rank": lr, "local_world_size": lws,
                           "metadata": metadata}  # fmt: skip
    if ready is not None:
        msg["ready"] = ready
    conn = FakeConn()
    return membership.register(conn, msg), conn


def sync_all(membership: Any, nodes: list[tuple[Any, Any]], local_ranks: tuple = (0,)) -> None:
    """Every rank in `local_ranks` of each `(node, conn)` reaches the sync point of the
    current epoch, admitting the nodes waiting."""
    for node, conn in nodes:
        for lr in local_ranks:
            membership.sync(node, lr, conn, 1, {"epoch": membership.epoch, "admit": True})


class FakeClock:
    """A clock that stands still until the test moves `now`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
