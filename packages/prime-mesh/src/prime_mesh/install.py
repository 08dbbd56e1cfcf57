"""Admission and group building of one node: waiting to be a member, then building the gloo
group of its epoch (abandoning it for a newer epoch that appears meanwhile).

Functions over a node's `Session`, split out of `prime_mesh.mesh` to keep it short; they
return the group built and its epoch, which the mesh then holds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prime_mesh.epoch import Epoch, start_build
from prime_mesh.errors import MeshError, MeshEvicted, MeshTimeout
from prime_mesh.session import Session

log = logging.getLogger("prime_mesh")


def admit(session: Session, timeout: float | None) -> tuple[Any, Epoch]:
    """Wait until this node is a member of an epoch, then build its group. MeshTimeout
    after `timeout` seconds not admitted (None: only the connection's loss ends the wait)."""
    start = time.monotonic()

    def admitted() -> bool:
        return session.latest is not None and session.node_id in session.latest.members

    while not session.client.wait_for(admitted, 30.0 if timeout is None else min(30.0, timeout)):
        session.client.check()
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise MeshTimeout(
                f"{session.node_id} was not admitted within {timeout:g}s (join_timeout): the "
                "members admit joiners at their next sync point, and the run forms once "
                "min_nodes nodes are ready; start the missing nodes, or raise join_timeout"
            )
        log.info(
            "%s waiting %.0fs to be admitted at the members' next sync point",
            session.node_id,
            waited,
        )
    assert session.latest is not None
    return install(session, session.latest)


def install(session: Session, target: Epoch) -> tuple[Any, Epoch]:
    """Build the group of `target` (or of any newer epoch that appears meanwhile); returns
    the group and its epoch. Each build ends within the group timeout (`pg_timeout`: gloo's
    rendezvous gives up), and three failed builds raise MeshError."""
    started = time.monotonic()
    # a backstop over gloo's own rendezvous timeout: no build is waited for past it
    bound = session.pg_timeout + session.heartbeat_timeout + 2 * session.heartbeat_interval
    failures = 0
    node_id = session.node_id
    while True:
        session.check()
        latest = session.latest
        if latest is not None and latest.number > target.number:
            target = latest
        if node_id not in target.members:
            session.client.wait_for(lambda: False, session.heartbeat_timeout)  # eviction notice
            session.check()
            raise MeshEvicted(
                f"{node_id} is not a member of epoch {target.number}; create a new mesh to rejoin"
            )
        box = start_build(
            session.store,
            target,
            node_id,
            session.local_rank,
            session.host,
            session.pg_timeout,
            done=session.client.notify,
        )
        n = target.number
        session.client.wait_for(lambda b=box, n=n: bool(b) or session.newer_than(n), bound)
        session.check()
        if not box and not session.newer_than(n):
            raise MeshTimeout(
                f"building the inter-node group of epoch {n} did not end within {bound:g}s"
            )
        if "pg" in box:
            log.info(
                "%s local rank %d: epoch %d, rank %d of %d (group built in %.2fs)",
                node_id,
                session.local_rank,
                target.number,
                target.members.index(node_id),
                len(target.members),
                time.monotonic() - started,
            )
            return box["pg"], target
        if session.newer_than(n):
            continue  # abandon this epoch's build; it times out on its own
        failures += 1
        log.warning("%s: building epoch %d's group failed: %s", node_id, target.number, box["err"])
        if session.client.wait_for(
            lambda n=n: session.newer_than(n),
            session.heartbeat_timeout + 2 * session.heartbeat_interval,
        ):
            continue
        session.check()
        if failures >= 3:
            raise MeshError(
                f"could not form the inter-node group of epoch {target.number}: {box['err']}"
            )
        reply = session.client.request(
            {"type": "sync", "epoch": target.number, "admit": False, "failed": True},
            timeout=session.request_bound,
            what="the other members to reach their sync point (after a failed group build)",
        )
        session.note_epoch(reply["epoch"])
