"""Reading a run's membership without joining it (`prime-mesh status`)."""

from __future__ import annotations

from prime_mesh.client import CoordinatorClient
from prime_mesh.wire import resolve_token


def query_status(coordinator: str, token: str | bytes | None = None, timeout: float = 10.0) -> dict:
    """The coordinator's view: epoch, min_nodes, and every node with its state, rank,
    last-heartbeat age (by the coordinator's clock) and metadata."""
    client = CoordinatorClient(coordinator, resolve_token(token), connect_timeout=timeout)
    try:
        return dict(client.request({"type": "status"}, timeout=timeout)["status"])
    finally:
        client.close()


def format_status(status: dict, address: str) -> str:
    nodes = status["nodes"]
    count = {s: sum(n["state"] == s for n in nodes) for s in ("member", "joining", "waiting")}
    # "joining": ready, admitted at the next sync point; "waiting": not ready, never waited for
    lines = [
        f"coordinator {address}: epoch {status['epoch']}, {count['member']} members, "
        f"{count['joining']} joining, {count['waiting']} waiting, "
        f"{len(nodes) - sum(count.values())} registering (min_nodes {status['min_nodes']})"
    ]
    width = max([10, *(len(n["node_id"]) for n in nodes)])
    for n in nodes:
        age = n["last_heartbeat_age"]
        lines.append(
            f"  {n['node_id']:<{width}} {n['state']:<11} rank {'-' if n['rank'] is None else n['rank']:<3} "
            f"local_world_size {n['local_world_size']}  heartbeat {'-' if age is None else f'{age:.1f}s'} ago  "
            f"metadata {n['metadata']}"
        )
    return "\n".join(lines)
