"""A node's session with the coordinator: what `ElasticDeviceMesh`, `prime_mesh.install` and
`prime_mesh.reconnect` share.

The session holds who this local rank is (node id, local rank, gloo host), its connection to
the coordinator and the coordinator's rendezvous store (both replaced together when it
reconnects), and the epochs the coordinator pushed: the newest one, and every node admitted
at a members' sync point. The group this local rank holds is the mesh's own.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack

from prime_mesh.barrier import request_bound
from prime_mesh.client import CoordinatorClient
from prime_mesh.epoch import Epoch, connect_store
from prime_mesh.errors import CoordinatorUnreachable, MeshClosed, MeshNameTaken

log = logging.getLogger("prime_mesh")


class Session:
    """Connects and registers on construction (`register` is the registration message; the
    first one adds `first`). `open()` connects again (after the coordinator was lost);
    `close()` leaves the run."""

    def __init__(
        self,
        address: str,
        key: bytes,
        register: dict,
        *,
        first: dict,
        host: str | None,
        local_rank: int,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        connect_timeout: float,
        pg_timeout: float,
        sync_timeout: float | None = None,
        unreachable_grace: float = 0.0,
    ) -> None:
        self.address, self.key, self.register = address, key, register
        self.unreachable_grace = unreachable_grace  # (the first connection's, see _open_first)
        # the bound on waiting for the coordinator at a sync point or vote (see barrier)
        self.request_bound = request_bound(sync_timeout, heartbeat_timeout, heartbeat_interval)
        self.local_rank = local_rank
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self.connect_timeout, self.pg_timeout = connect_timeout, pg_timeout
        self.latest: Epoch | None = None  # the newest epoch the coordinator pushed
        self.joined: set[str] = set()  # node ids admitted at a members' sync point (so far)
        self.closed = False
        self.client: CoordinatorClient
        self.store: Any = None  # torch.distributed.TCPStore of the coordinator
        reply = self._open_first(first)
        try:
            self.host = host or self.client.local_host
            self.node_id: str = reply["node_id"]
            self.joining = bool(reply.get("joining"))  # the coordinator's "auto" decision
            if reply.get("epoch"):
                self.note_epoch(reply["epoch"])
        except BaseException:
            self.client.close()
            raise

    def _open_first(self, first: dict) -> dict:
        """`open(first)`. While nothing answers at the address, retry for `unreachable_grace`
        seconds: a node started while the coordinator restarts (or before it started) waits
        for it as long as a member that lost it mid-run does. While the node's name is held
        by another registration, retry for one heartbeat timeout: a node restarted under its
        name takes it back once the coordinator has evicted the dead one, while a live holder
        keeps it (MeshNameTaken)."""
        t0 = time.monotonic()
        deadline = t0 + self.heartbeat_timeout + 2 * self.heartbeat_interval
        told = unreachable_told = False
        while True:
            try:
                return self.open(first)
            except CoordinatorUnreachable as e:
                waited = time.monotonic() - t0
                if waited >= self.unreachable_grace:
                    raise CoordinatorUnreachable(
                        f"{e} (waited {waited:.0f} s)" if waited >= 1 else str(e)
                    ) from None
                if not unreachable_told:
                    log.warning("%s; retrying for up to %g s", e, self.unreachable_grace)
                    unreachable_told = True
                time.sleep(min(1.0, self.unreachable_grace))
            except MeshNameTaken as e:
                if time.monotonic() >= deadline:
                    raise MeshNameTaken(
                        f"{e} (still held after {self.heartbeat_timeout:g} s)"
                    ) from None
                if not told:
                    log.info("%s; retrying for %g s in case it died", e, self.heartbeat_timeout)
                    told = True
                time.sleep(self.heartbeat_interval)

    def open(self, extra: dict) -> dict:
        """Connect to the coordinator, register (`register` and `extra`), start heartbeats and
        connect to its store; the new connection replaces the old one only once all that
        succeeded (a failed one is closed). Returns the registration reply."""
        client = CoordinatorClient(
            self.address,
            self.key,
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout,
            connect_timeout=self.connect_timeout,
            on_message=self.on_message,
        )
        try:
            reply = client.request(
                {**self.register, **extra},
                timeout=self.connect_timeout,
                what="the coordinator to answer the registration",
            )
            client.start_heartbeats()
            store_host = reply["store"][0] or client.coordinator_host
            store = connect_store(
                store_host, int(reply["store"][1]), self.connect_timeout, self.pg_timeout
            )
        except BaseException:
            client.close()
            raise
        self.client, self.store = client, store
        return reply

    def on_message(self, msg: dict) -> None:
        """What the coordinator pushes (called by the client's reader thread, under its lock)."""
        if msg.get("type") == "epoch" and msg.get("epoch"):
            e = Epoch.parse(msg["epoch"])
            self.joined.update(e.joined)  # before a newer epoch replaces it in `latest`
            if self.latest is None or e.number > self.latest.number:
                self.latest = e

    def note_epoch(self, info: dict) -> None:
        """An epoch the coordinator answered with (a sync reply, a registration)."""
        self.on_message({"type": "epoch", "epoch": info})

    def newer_than(self, number: int) -> bool:
        return self.latest is not None and self.latest.number > number

    def void_after(self, epoch: Epoch) -> None:
        """Forget the epochs pushed after `epoch`: a lost coordinator's epoch that this node
        never installed is void (the restarted coordinator numbers its epochs from the
        installed ones reported to it)."""
        self.latest = epoch

    def check(self) -> None:
        """Raise MeshClosed once closed, else the error that ended the connection, if any."""
        if self.closed:
            raise MeshClosed("this ElasticDeviceMesh was closed; create a new one to join again")
        self.client.check()

    def close(self, completed: bool = False) -> None:
        """Leave the run (best effort; `completed`: this node finished it) and close the
        connection."""
        self.closed = True
        self.client.leave(completed)
        self.client.close()


def checked_metadata(
    metadata: dict | None, heartbeat_interval: float, heartbeat_timeout: float
) -> dict:
    """A copy of a registration's `metadata`, once the arguments are known to be valid (else
    ValueError)."""
    if not 0 < heartbeat_interval < heartbeat_timeout:
        raise ValueError(
            f"need 0 < heartbeat_interval ({heartbeat_interval}) < heartbeat_timeout ({heartbeat_timeout})"
        )
    metadata = dict(metadata or {})
    try:
        msgpack.packb(metadata)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"metadata must hold plain values (str, numbers, lists, dicts): {e}"
        ) from None
    return metadata
