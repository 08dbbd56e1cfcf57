"""A node's session with the coordinator, and getting it back after the coordinator died.

`open_session` connects, authenticates, registers and reaches the coordinator's rendezvous
store: how a node joins, and how it reconnects. `recover` runs at a sync point once the
coordinator is lost: it retries the same address for `coordinator_grace_s` seconds, registers
with what the node knows of the run (epoch, members, outer step and weight hash; see
`prime_mesh.reform` for what the restarted coordinator does with it), and installs the
re-formed epoch. The node's inner steps went on meanwhile: only sync points need a coordinator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prime_mesh.client import CoordinatorClient
from prime_mesh.epoch import connect_store
from prime_mesh.errors import CoordinatorGone, CoordinatorLost

if TYPE_CHECKING:
    from prime_mesh.mesh import ElasticDeviceMesh

log = logging.getLogger("prime_mesh")

_NOTE_EVERY = 10.0  # seconds between "still waiting" lines


def open_session(
    address: str,
    key: bytes,
    register: dict,
    *,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    connect_timeout: float,
    pg_timeout: float,
    on_message: Callable[[dict], None],
) -> tuple[CoordinatorClient, dict, Any]:
    """Connect to the coordinator, send `register`, start heartbeats and connect to its store.
    Returns (client, registration reply, store); the client is closed if any step fails."""
    client = CoordinatorClient(
        address,
        key,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        connect_timeout=connect_timeout,
        on_message=on_message,
    )
    try:
        reply = client.request(
            register, timeout=connect_timeout, what="the coordinator to answer the registration"
        )
        client.start_heartbeats()
        store_host = reply["store"][0] or client.coordinator_host
        store = connect_store(store_host, int(reply["store"][1]), connect_timeout, pg_timeout)
    except BaseException:
        client.close()
        raise
    return client, reply, store


def recover(mesh: ElasticDeviceMesh, cause: Exception) -> None:
    """Reconnect `mesh` (a member that lost its coordinator) to a coordinator restarted on the
    same address and install the re-formed epoch. Raises CoordinatorGone when none answers
    within the grace period, MeshEvicted when the run re-formed without this node (it rejoins
    through live recovery), MeshAuthError when the coordinator there does not share the token."""
    epoch = mesh._epoch
    assert epoch is not None
    address, grace = mesh._client.address, mesh.coordinator_grace_s
    mesh._client.close()
    # An epoch the lost coordinator pushed but this node never installed is void: the
    # restarted coordinator numbers its epochs from the installed ones reported to it.
    mesh._latest = epoch
    outer_step, outer_hash = mesh._outer
    started = time.monotonic()
    deadline = started + grace
    log.warning(
        "%s: lost the coordinator at %s (%s); waiting up to %gs (coordinator_grace_s) for a "
        "coordinator at that address to re-form the run at outer step %d",
        mesh.node_id,
        address,
        cause,
        grace,
        outer_step,
    )
    register = {
        **mesh._register,
        "resume": {
            "node_id": mesh.node_id,
            "epoch": epoch.number,
            "members": list(epoch.members),
            "outer_step": outer_step,
            "outer_hash": outer_hash,
        },
    }
    note = started + _NOTE_EVERY
    while True:
        try:
            client, _, store = open_session(address, mesh._key, register, **mesh._session_args)
            break
        except (CoordinatorLost, TimeoutError) as e:  # not back yet (or not answering yet)
            now = time.monotonic()
            if now >= deadline:
                raise CoordinatorGone(
                    f"no coordinator answered at {address} for {grace:g}s "
                    f"(mesh.coordinator_grace_s) after it was lost: {e}"
                ) from None
            if now >= note:
                log.warning(
                    "%s: still waiting for the coordinator at %s (%.0fs of %gs)",
                    mesh.node_id,
                    address,
                    now - started,
                    grace,
                )
                note = now + _NOTE_EVERY
            time.sleep(min(1.0, max(deadline - now, 0.0)))
    mesh._client, mesh._store = client, store
    log.info(
        "%s: reconnected to the coordinator at %s after %.1fs; waiting for the run to re-form",
        mesh.node_id,
        address,
        time.monotonic() - started,
    )

    def reformed() -> bool:
        latest = mesh._latest
        return latest is not None and latest.number > epoch.number

    # The coordinator waits for the other members (up to its --reform-wait): allow that even
    # when the coordinator came back late in the grace period.
    until = max(deadline, time.monotonic() + 2 * grace)
    while not client.wait_for(reformed, _NOTE_EVERY):
        client.check()  # MeshEvicted: the run re-formed without this node
        if time.monotonic() >= until:
            raise CoordinatorGone(
                f"the coordinator at {address} came back but did not re-form the run "
                f"within {until - started:.0f}s"
            )
        log.info("%s: waiting for the other members to reconnect", mesh.node_id)
    assert mesh._latest is not None
    mesh._fresh = False
    mesh._install(mesh._latest)
