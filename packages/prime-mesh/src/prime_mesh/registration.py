"""A registration message checked before the coordinator's state changes: its fields, its
name, and whether the node fits the run (the same local ranks and config as its nodes).

Pure functions: every refusal is a `Refused` (or a subclass) whose text the node prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from prime_mesh.address import check_name
from prime_mesh.barrier import checked_sync_timeout
from prime_mesh.node import Node
from prime_mesh.reform import Refused
from prime_mesh.settings_diff import settings_differences


@dataclass(frozen=True)
class Registration:
    """One local rank's registration, its fields checked."""

    key: str
    local_rank: int
    local_world_size: int
    metadata: dict
    name: str | None
    heartbeat_timeout: float  # clamped to [0.1, 3600] s
    sync_timeout: float | None


def parse_registration(msg: dict) -> Registration:
    """The checked fields of a `register` message; `Refused` naming what is malformed."""
    key, lr, lws = msg.get("node_key"), msg.get("local_rank"), msg.get("local_world_size")
    metadata = msg.get("metadata") or {}
    if not (isinstance(key, str) and isinstance(lr, int) and isinstance(lws, int)):
        raise Refused("malformed registration (node_key, local_rank, local_world_size)")
    if not (lws >= 1 and 0 <= lr < lws) or not isinstance(metadata, dict):
        raise Refused(f"bad registration: local_rank {lr} of local_world_size {lws}")
    name = msg.get("name")
    if name is not None:
        try:
            check_name(name)
        except ValueError as e:
            raise Refused(str(e)) from None
    hb = msg.get("heartbeat_timeout", 5.0)
    if not isinstance(hb, int | float):
        raise Refused("malformed registration (heartbeat_timeout)")
    try:
        sync_timeout = checked_sync_timeout(msg.get("sync_timeout"))
    except ValueError as e:
        raise Refused(f"malformed registration: {e}") from None
    return Registration(
        key=key,
        local_rank=lr,
        local_world_size=lws,
        metadata=metadata,
        name=name,
        heartbeat_timeout=float(min(max(hb, 0.1), 3600.0)),
        sync_timeout=sync_timeout,
    )


def check_fits_run(reg: Registration, run: Node | None) -> None:
    """Refuse a node that differs from `run` (a node of the run; None: no run yet) in its
    number of local ranks or its config hash (naming the settings that differ)."""
    if run is None:
        return
    if run.local_world_size != reg.local_world_size:
        raise Refused(
            f"local_world_size {reg.local_world_size} differs from the run's "
            f"{run.local_world_size}: start every node with the same number of local ranks"
        )
    mine, theirs = reg.metadata.get("config_hash"), run.metadata.get("config_hash")
    if theirs != mine:
        differ = settings_differences(run.metadata.get("settings"), reg.metadata.get("settings"))
        raise Refused(
            f"config hash {mine!r} differs from the run's {theirs!r}{differ}; start this node "
            "with the run's config"
        )
