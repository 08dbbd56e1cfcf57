"""A node as the coordinator sees it: its local ranks' connections, heartbeats and state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from prime_mesh.reform import Resume


class Conn(Protocol):
    peer: str

    def send(self, msg: dict) -> None: ...
    def close_after_flush(self) -> None: ...


@dataclass
class Node:
    key: str
    node_id: str
    local_world_size: int
    metadata: dict
    heartbeat_timeout: float
    conns: dict[int, Conn] = field(default_factory=dict)
    last_seen: dict[int, float] = field(default_factory=dict)
    member: bool = False
    address: str = ""  # as the coordinator sees local rank 0's connection
    ready_ranks: set[int] = field(default_factory=set)
    resume: Resume | None = None  # reconnected after a coordinator restart (see reform)
    sync_timeout: float | None = None  # seconds it asked late members be waited for; None: auto
    joining: bool = False  # registered "auto" into a running job: waits until ready()
    founding: bool = False  # registered "auto" while no run was running: one of its founders

    @property
    def complete(self) -> bool:
        return len(self.conns) == self.local_world_size

    @property
    def ready(self) -> bool:
        return len(self.ready_ranks) == self.local_world_size


def name_held(holder: Node, state: str, now: float) -> str:
    """Why a registration under `holder`'s name is refused while `holder` is live."""
    ages = [now - t for t in holder.last_seen.values()]
    seen = f"last heartbeat {max(ages):.1f} s ago" if ages else "no heartbeat yet"
    return (
        f"the node name {holder.node_id!r} is held by a live node of this run "
        f"({state}, registered from {holder.address or 'unknown'}, {seen}): "
        "give this node a name of its own (prime-train: --mesh.node_name), or stop the "
        "other one. A node restarted under its name after it died takes it back once the "
        f"coordinator has evicted the old one (heartbeat timeout {holder.heartbeat_timeout:g} s)"
    )


def fresh_id(seq: int, taken: set[str]) -> tuple[int, str]:
    """The next "node-N" after counter `seq` for a node registered without a name (never one
    in `taken`): (the counter, the id)."""
    while True:
        seq += 1
        if f"node-{seq}" not in taken:
            return seq, f"node-{seq}"
