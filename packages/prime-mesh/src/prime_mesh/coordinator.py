"""The membership coordinator: a small TCP server, runnable alone or inside a trainer process.

It authenticates every connection (see `wire`), feeds messages into `Membership` under one
lock, and hosts the TCPStore that the inter-node gloo groups rendezvous through (each epoch
under a fresh random prefix). Both listen on the coordinator's host only: its port, and the
store's (`store_port`, 0: a free one). Heartbeats arrive over each local rank's persistent
connection, so a SIGKILLed node is evicted as soon as its socket closes.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import socket
import threading
from typing import Any

from prime_mesh.errors import MeshAuthError
from prime_mesh.membership import Membership, Refused
from prime_mesh.node import Node
from prime_mesh.wire import Channel, resolve_token, server_handshake

log = logging.getLogger("prime_mesh.coordinator")

_CLOSE = object()


class _Conn:
    """One client connection: a reader (in the handler thread) and a writer thread with a queue,
    so a slow or stopped client never blocks the coordinator's lock."""

    def __init__(self, channel: Channel, peer: str) -> None:
        self.channel = channel
        self.peer = peer
        self._out: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write, name=f"mesh-write-{peer}", daemon=True)
        self._writer.start()

    def send(self, msg: dict) -> None:
        self._out.put(msg)

    def close_after_flush(self) -> None:
        self._out.put(_CLOSE)

    def _write(self) -> None:
        while True:
            msg = self._out.get()
            if msg is _CLOSE:
                break
            try:
                self.channel.send(msg)
            except OSError:
                break
        self.channel.close()


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
    sock.listen(128)
    return sock


class Coordinator:
    """Membership authority of one run.

    `Coordinator(host, port=0, token=None, min_nodes=1).start()`; `.address` is "host:port"
    to give nodes; `.close()` stops it. The token defaults to env PRIME_TOKEN. The first epoch
    forms once `min_nodes` nodes are registered and ready; later nodes join at sync points.
    Restarted on the same address, it re-forms the run from the nodes that reconnect, waiting
    up to `reform_wait` seconds for the old members (see `prime_mesh.reform`).
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
    ) -> None:
        self._key = resolve_token(token)
        self.host = host
        self._port = port
        self._store_port = store_port
        self.advertise_host = advertise_host
        self.state = Membership(min_nodes=min_nodes, reform_wait=reform_wait)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._store: Any = None  # torch.distributed.TCPStore, the gloo rendezvous
        self._threads: list[threading.Thread] = []
        self._conns: set[_Conn] = set()
        self._status_servers: list[Any] = []

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
        for target, name in (
            (self._accept_loop, "mesh-accept"),
            (self._monitor_loop, "mesh-monitor"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("coordinator listening on %s (store port %d)", self.address, self.store_port)
        return self

    def status(self) -> dict:
        with self._lock:
            return self.state.status()

    def page_status(self) -> dict:
        """What the status page shows (see `Membership.page`): a copy, taken under the lock."""
        with self._lock:
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
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        for conn in list(self._conns):
            conn.channel.close()
        for server in self._status_servers:
            server.close()
        for t in self._threads:
            t.join(timeout=5)
        self._store = None

    def __enter__(self) -> Coordinator:
        return self.start() if self._sock is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- threads -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            t = threading.Thread(
                target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True
            )
            t.start()

    def _monitor_loop(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                self.state.tick()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(10.0)  # the handshake must not pin a thread forever
        try:
            channel = server_handshake(sock, self._key)
            first = channel.recv()
        except (MeshAuthError, OSError, ConnectionError) as e:
            log.warning("refused connection from %s: %s", peer, e)
            Channel(sock, b"", b"S", b"", b"").refuse(f"authentication failed: {e}")
            return
        sock.settimeout(None)
        conn = _Conn(channel, peer)
        self._conns.add(conn)
        node: Node | None = None
        lr = 0
        msg: dict | None = first
        try:
            while msg is not None and not self._stop.is_set():
                node, lr = self._dispatch(conn, node, lr, msg)
                msg = channel.recv()
        except MeshAuthError as e:
            log.warning("refused message from %s: %s", peer, e)
            conn.send({"type": "error", "error": f"refused: {e}"})
        except (OSError, ConnectionError, Refused):
            pass
        except Exception:  # a bug or malformed fields from an authenticated peer: drop only it
            log.exception("closing the connection from %s after an error", peer)
        finally:
            self._conns.discard(conn)
            # A closing coordinator evicts no one: pushing the epochs of its own shutdown would
            # leave the nodes holding epochs that a restarted coordinator numbers again.
            if node is not None and not self._stop.is_set():
                with self._lock:
                    self.state.evict(node, f"connection of local rank {lr} closed")
            conn.close_after_flush()

    def _dispatch(
        self, conn: _Conn, node: Node | None, lr: int, msg: dict
    ) -> tuple[Node | None, int]:
        kind, req = msg.get("type"), msg.get("id", 0)
        with self._lock:
            if kind == "status":
                conn.send({"type": "reply", "id": req, "status": self.state.status()})
            elif kind == "register" and node is None:
                try:
                    node = self.state.register(conn, msg)
                except Refused as e:
                    log.warning("refused registration from %s: %s", conn.peer, e)
                    conn.send({"type": "reply", "id": req, "error": str(e), "kind": e.kind})
                    raise
                lr = int(msg["local_rank"])
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
