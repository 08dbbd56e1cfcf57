"""The membership coordinator: a small TCP server, runnable alone or inside a trainer process.

It serves every connection from one thread (`prime_mesh.connections`: an event loop, so its
threads are bounded whatever the number of nodes), authenticates each (see `wire`), feeds
messages into `Membership` under one lock, and hosts the TCPStore that the inter-node gloo
groups rendezvous through (each epoch under a fresh random prefix). Both listen on the
coordinator's host only: its port, and the store's (`store_port`, 0: a free one).
Heartbeats arrive over each local rank's persistent connection, so a SIGKILLed node is
evicted as soon as its socket closes.
"""

from __future__ import annotations

import datetime
import logging
import os
import resource
import socket
import threading
from typing import Any

from prime_mesh.connections import PEER_CLOSED, ConnectionLoop, LoopConn
from prime_mesh.departures import DEPART_BATCH_S
from prime_mesh.membership import Membership, Refused
from prime_mesh.node import Node
from prime_mesh.wire import resolve_token

log = logging.getLogger("prime_mesh.coordinator")


def _raise_open_files() -> None:
    """Lift this process's soft limit on open files to its hard limit: each node holds two
    (its connection, its store client), and the usual soft limit of 1024 caps a run at ~500."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 16
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


def _listen(host: str, port: int, option: str) -> socket.socket:
    """A TCP socket listening on host:port, or OSError naming the option to change."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another {option}"
        ) from None
    sock.listen(4096)  # a join storm of hundreds of nodes (the kernel caps it at somaxconn)
    return sock


class Coordinator:
    """Membership authority of one run.

    `Coordinator(host, port=0, token=None, min_nodes=1).start()`; `.address` is "host:port"
    to give nodes; `.close()` stops it. The token defaults to env PRIME_TOKEN. The first epoch
    forms once `min_nodes` nodes are registered and ready; later nodes join at sync points.
    Restarted on the same address, it re-forms the run from the nodes that reconnect, waiting
    up to `reform_wait` seconds for the old members (see `prime_mesh.reform`). A connection
    must complete its handshake within `handshake_s`; at most `max_pending_per_address` may be
    in their handshake per address, `max_conns` open in all (see `prime_mesh.connections`).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | bytes | None = None,
        *,
        min_nodes: int = 1,
        store_port: int = 0,
        advertise_host: str | None = None,
        reform_wait: float = 30.0,
        handshake_s: float = 10.0,
        max_conns: int = 4096,
        max_pending_per_address: int = 256,
    ) -> None:
        self._key = resolve_token(token)
        self._limits = {
            "handshake_s": handshake_s,
            "max_conns": max_conns,
            "max_pending_per_address": max_pending_per_address,
        }
        self.host = host
        self._port = port
        self._store_port = store_port
        self.advertise_host = advertise_host
        self.state = Membership(
            min_nodes=min_nodes, reform_wait=reform_wait, depart_batch_s=DEPART_BATCH_S
        )
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._store: Any = None  # torch.distributed.TCPStore, the gloo rendezvous
        self._loop: ConnectionLoop | None = None
        self._thread: threading.Thread | None = None
        self._status_servers: list[Any] = []
        self.failed: str | None = None  # why the connection loop ended by itself (a bug)

    @property
    def address(self) -> str:
        if self._sock is None:
            raise RuntimeError("coordinator not started; call start() first")
        host = self.advertise_host or self.host
        return f"{host}:{self._sock.getsockname()[1]}"

    @property
    def store_port(self) -> int:
        assert self._store is not None, "coordinator not started"
        return self._store.port

    def start(self) -> Coordinator:
        _raise_open_files()
        self._sock = _listen(self.host, self._port, "--port")
        try:
            store_sock = _listen(self.host, self._store_port, "--store-port")
        except BaseException:
            self.close()
            raise
        import torch.distributed as dist  # here, so a busy port or a bad token fails before torch loads

        # TCPStore alone listens on every interface whatever host it is given: hand it a
        # socket bound to the coordinator's host (it owns the fd from then on, and closes it).
        fd = os.dup(store_sock.fileno())
        port = store_sock.getsockname()[1]
        store_sock.close()
        try:
            self._store = dist.TCPStore(
                self.host,
                port,
                None,
                True,
                timeout=datetime.timedelta(seconds=60),
                wait_for_workers=False,
                master_listen_fd=fd,
            )
        except BaseException:
            self.close()
            raise
        self._loop = ConnectionLoop(self._sock, self._key, self, **self._limits)
        self._thread = threading.Thread(target=self._run_loop, name="mesh-loop", daemon=True)
        self._thread.start()
        log.info("coordinator listening on %s (store port %d)", self.address, self.store_port)
        return self

    def _run_loop(self) -> None:
        """The connection loop; should it fail (a bug), the coordinator stops (`wait()`
        returns, `failed` says why) rather than live on without serving: restarted, the nodes
        re-form the run with it, as after any coordinator restart."""
        assert self._loop is not None
        try:
            self._loop.run()
        except Exception as e:
            if not self._stop.is_set():
                self.failed = f"{type(e).__name__}: {e}"
                log.exception("the coordinator's connection loop failed; the coordinator stops")
                self._stop.set()

    def status(self) -> dict:
        with self.lock:
            return self.state.status()

    def page_status(self) -> dict:
        """What the status page shows (see `Membership.page`): a copy, taken under the lock."""
        with self.lock:
            return self.state.page()

    def serve_status(self, host: str = "127.0.0.1", port: int = 0) -> Any:
        """Serve the read-only status page, `/api/status` and `/metrics` (needs the
        `prime-mesh[status]` extra); returns the server (`.url`), closed with the coordinator."""
        from prime_mesh.status_server import StatusServer

        server = StatusServer(self, host, port).start()
        self._status_servers.append(server)
        return server

    def wait(self, timeout: float | None = None) -> bool:
        """Block until close(); True if closed."""
        return self._stop.wait(timeout)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._loop is not None:
            self._loop.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        for server in self._status_servers:
            server.close()
        self._store = None

    def __enter__(self) -> Coordinator:
        return self.start() if self._sock is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the connection loop's calls (under the lock) -------------------------------------
    def on_tick(self) -> None:
        self.state.tick()

    def on_message(self, conn: LoopConn, msg: dict) -> None:
        try:
            conn.node, conn.lr = self._dispatch(conn, conn.node, conn.lr, msg)  # type: ignore[arg-type]
        except Refused:  # answered: the connection closes once the answer is written
            conn.close_after_flush()

    def on_close(self, conn: LoopConn, why: str) -> None:
        node, conn.node = conn.node, None
        # A closing coordinator evicts no one: pushing the epochs of its own shutdown would
        # leave the nodes holding epochs that a restarted coordinator numbers again.
        if isinstance(node, Node) and not self._stop.is_set():
            cause = "" if why == PEER_CLOSED else f" ({why})"  # (said only when unusual)
            self.state.evict(node, f"connection of local rank {conn.lr} closed{cause}")

    def _dispatch(
        self, conn: LoopConn, node: Node | None, lr: int, msg: dict
    ) -> tuple[Node | None, int]:
        kind, req = msg.get("type"), msg.get("id", 0)
        if kind == "status":
            conn.send({"type": "reply", "id": req, "status": self.state.status()})
        elif kind == "register" and node is None:
            return self._register(conn, req, msg), int(msg["local_rank"])
        elif node is None:
            conn.send({"type": "reply", "id": req, "error": f"{kind!r} before registering"})
        elif self.state.nodes.get(node.key) is not node:
            pass  # evicted: it has been told so and its connection is closing
        elif kind == "hb":
            self.state.heartbeat(node, lr, msg.get("progress"))
            conn.send({"type": "ack", "epoch": self.state.epoch})
        elif kind == "sync":
            self.state.sync(node, lr, conn, req, msg)
        elif kind == "ready":
            self.state.ready(node, lr)
            conn.send({"type": "reply", "id": req, "state": self.state.state_of(node)})
        elif kind == "vote":
            self.state.vote(node, lr, conn, req, msg)
        elif kind == "leave":
            self.state.leave(node, bool(msg.get("completed")))
            node = None
        else:
            conn.send({"type": "reply", "id": req, "error": f"unknown message type {kind!r}"})
        return node, lr

    def _register(self, conn: LoopConn, req: int, msg: dict) -> Node:
        try:
            node = self.state.register(conn, msg)
        except Refused as e:
            log.warning("refused registration from %s: %s", conn.peer, e)
            conn.send({"type": "reply", "id": req, "error": str(e), "kind": e.kind})
            raise
        conn.send(
            {
                "type": "reply",
                "id": req,
                "node_id": node.node_id,
                "store": [self.advertise_host, self.store_port],
                "epoch": self.state.epoch_info() if node.member else None,
                "joining": node.joining,
            }
        )
        return node
