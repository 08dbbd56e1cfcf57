"""Admission and group building of one node: waiting to be a member, then building the gloo
group of its epoch (abandoning it for a newer epoch that appears meanwhile).

Functions over an `ElasticDeviceMesh`'s state, split out of `prime_mesh.mesh` to keep it short.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from prime_mesh.epoch import Epoch, retire, start_build
from prime_mesh.errors import MeshError, MeshEvicted

if TYPE_CHECKING:
    from prime_mesh.mesh import ElasticDeviceMesh

log = logging.getLogger("prime_mesh")


def admit(mesh: ElasticDeviceMesh, timeout: float | None) -> None:
    """Wait until this node is a member of an epoch, then build its group."""
    start = time.monotonic()

    def admitted() -> bool:
        return mesh._latest is not None and mesh.node_id in mesh._latest.members

    while not mesh._client.wait_for(admitted, 30.0):
        mesh._client.check()
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise TimeoutError(
                f"{mesh.node_id} was not admitted within {timeout:g}s: the members admit "
                "joiners at their next sync point (or the run has fewer than min_nodes nodes)"
            )
        log.info(
            "%s waiting %.0fs to be admitted at the members' next sync point",
            mesh.node_id,
            waited,
        )
    assert mesh._latest is not None
    mesh._install(mesh._latest)
    mesh._fresh = mesh.node_id in mesh._joined


def install(mesh: ElasticDeviceMesh, target: Epoch) -> None:
    """Build the group of `target` (or of any newer epoch that appears meanwhile)."""
    started = time.monotonic()
    failures = 0
    while True:
        mesh._check()
        if mesh._latest is not None and mesh._latest.number > target.number:
            target = mesh._latest
        if mesh.node_id not in target.members:
            mesh._client.wait_for(lambda: False, mesh.heartbeat_timeout)  # eviction notice
            mesh._check()
            raise MeshEvicted(
                f"{mesh.node_id} is not a member of epoch {target.number}; create a new mesh to rejoin"
            )
        box = start_build(
            mesh._store,
            target,
            mesh.node_id,
            mesh.local_rank,
            mesh.host,
            mesh._pg_timeout,
            done=mesh._client.notify,
        )
        n = target.number
        mesh._client.wait_for(lambda b=box, n=n: bool(b) or mesh._newer_than(n), None)
        mesh._check()
        if "pg" in box:
            if mesh._pg is not None:
                retire(mesh._pg)
            mesh._pg, mesh._epoch = box["pg"], target
            mesh._vote_seq, mesh._suspect = 0, False
            log.info(
                "%s local rank %d: epoch %d, rank %d of %d (group built in %.2fs)",
                mesh.node_id,
                mesh.local_rank,
                target.number,
                mesh.global_rank,
                mesh.global_world_size,
                time.monotonic() - started,
            )
            return
        if mesh._newer_than(n):
            continue  # abandon this epoch's build; it times out on its own
        failures += 1
        log.warning(
            "%s: building epoch %d's group failed: %s", mesh.node_id, target.number, box["err"]
        )
        if mesh._client.wait_for(
            lambda n=n: mesh._newer_than(n),
            mesh.heartbeat_timeout + 2 * mesh.heartbeat_interval,
        ):
            continue
        mesh._check()
        if failures >= 3:
            raise MeshError(
                f"could not form the inter-node group of epoch {target.number}: {box['err']}"
            )
        reply = mesh._client.request(
            {"type": "sync", "epoch": target.number, "admit": False, "failed": True}
        )
        mesh._on_message({"type": "epoch", "epoch": reply["epoch"]})
