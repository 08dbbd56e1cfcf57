"""The coordinator's connections, all served by one thread: an event loop (selectors).

Bounded whatever the number of nodes: one thread, non-blocking reads and writes, and each
connection's unsent output capped (`SEND_CAP`): a peer that does not read (stopped, cut off)
overflows it and is dropped, never waited for. What a peer without the token can hold is
bounded too: the whole handshake (its hello, then its first authenticated message) must end
within `handshake_s`; before that, frames are capped to what a handshake needs (`HELLO_MAX`,
then `FIRST_MAX` for the first message, a registration); connections still in their
handshake are capped per address, and all connections in total. Refusals are logged at
most once per address per minute; a connection that closes before sending anything (a
port probe) is no refusal.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import Counter
from typing import Protocol

import msgpack

from prime_mesh.errors import MeshAuthError
from prime_mesh.wire import (
    HELLO_MAX,
    MAX_FRAME,
    Channel,
    frame_bytes,
    frame_length,
    server_channel,
    server_hello,
)

log = logging.getLogger("prime_mesh.coordinator")

SEND_CAP = 1 << 20  # unsent bytes per connection: thousands of epochs or replies
FIRST_MAX = 64 << 10  # the first authenticated message: a registration and its metadata
CLOSE_GRACE_S = 5.0  # a closing connection's last words (a refusal, "evicted") get this long
LOG_EVERY_S = 60.0

PEER_CLOSED = "connection closed by peer"  # the ordinary end: a node that exits or dies


class Handler(Protocol):
    """What the loop calls, in its thread; `lock` is held around each call."""

    lock: threading.Lock

    def on_message(self, conn: LoopConn, msg: dict) -> None: ...
    def on_close(self, conn: LoopConn, why: str) -> None: ...
    def on_tick(self) -> None: ...


class RefusalLog:
    """WARNING for a refused connection, at most once per address per `every` seconds."""

    def __init__(self, every: float = LOG_EVERY_S) -> None:
        self.every = every
        self._last: dict[str, float] = {}
        self._quiet: Counter[str] = Counter()  # refusals not logged since the last line

    def refused(self, ip: str, peer: str, reason: str, now: float) -> None:
        last = self._last.get(ip)
        if last is not None and now - last < self.every:
            self._quiet[ip] += 1
            return
        if len(self._last) > 10_000:  # a flood from many addresses: forget the old ones
            self._last = {a: t for a, t in self._last.items() if now - t < self.every}
        more = self._quiet.pop(ip, 0)
        extra = f" (and {more} more from {ip} since the last such line)" if more else ""
        log.warning("refused connection from %s: %s%s", peer, reason, extra)
        self._last[ip] = now


class LoopConn:
    """One client connection (the coordinator's `Conn`): `send` queues a message without
    blocking; `node` and `lr` say who registered over it (the coordinator's to set)."""

    def __init__(self, loop: ConnectionLoop, sock: socket.socket, addr: tuple, now: float):
        self.loop, self.sock = loop, sock
        self.ip, self.peer = addr[0], f"{addr[0]}:{addr[1]}"
        self.channel: Channel | None = None
        self.authenticated = False
        self.deadline: float | None = now + loop.handshake_s
        self.nonce, hello = server_hello()
        self.inbuf, self.out = bytearray(), bytearray(hello)
        self.closing = self.closed = False
        self.node: object | None = None
        self.lr = 0

    def send(self, msg: dict) -> None:
        if self.closing or self.closed or self.channel is None:
            return
        self.queue(self.channel.pack(msg))

    def queue(self, data: bytes) -> None:
        if len(self.out) + len(data) > SEND_CAP:
            self.loop.overflow(self)
            return
        self.out += data
        self.loop.want_write(self)

    def close_after_flush(self) -> None:
        if not (self.closing or self.closed):
            self.closing = True
            self.loop.closing(self)


class ConnectionLoop:
    """Serves the connections of `sock` (listening) in `run()` until `stop()`."""

    def __init__(
        self,
        sock: socket.socket,
        key: bytes,
        handler: Handler,
        *,
        handshake_s: float = 10.0,
        max_conns: int = 4096,
        max_pending_per_address: int = 256,
        tick_s: float = 0.1,
    ) -> None:
        self.key, self.handler = key, handler
        self.handshake_s, self.tick_s = handshake_s, tick_s
        self.max_conns, self.max_pending = max_conns, max_pending_per_address
        self._listen = sock
        sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.conns: set[LoopConn] = set()
        self._pending: Counter[str] = Counter()  # connections in their handshake, per address
        self._timed: set[LoopConn] = set()  # those with a deadline: handshaking or closing
        self._dirty: set[LoopConn] = set()  # output to write
        self._overflowed: set[LoopConn] = set()
        self.refusals = RefusalLog()
        self._stopping = False
        self._thread: int | None = None

    # ---- called by connections and other threads -----------------------------------------
    def want_write(self, conn: LoopConn) -> None:
        self._dirty.add(conn)
        if threading.get_ident() != self._thread:
            self.wake()

    def closing(self, conn: LoopConn) -> None:
        conn.deadline = time.monotonic() + CLOSE_GRACE_S
        self._timed.add(conn)
        self.want_write(conn)

    def overflow(self, conn: LoopConn) -> None:
        self._overflowed.add(conn)

    def wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the loop is already due to wake) or closed
            pass

    def stop(self) -> None:
        self._stopping = True
        self.wake()

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        self._thread = threading.get_ident()
        next_tick = time.monotonic()
        try:
            while not self._stopping:
                for key, mask in self._sel.select(max(0.0, next_tick - time.monotonic())):
                    self._event(key.data, mask)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + self.tick_s
                    self._expire(now)
                    with self.handler.lock:
                        self.handler.on_tick()
                self._settle()
        finally:
            for conn in list(self.conns):
                self._drop(conn, "the coordinator stopped", notify=False)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _event(self, data: object, mask: int) -> None:
        if data == "accept":
            self._accept()
        elif data == "wake":
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        elif isinstance(data, LoopConn) and not data.closed:
            if mask & selectors.EVENT_WRITE:
                self._flush(data)
            if mask & selectors.EVENT_READ and not data.closed:
                self._read(data)

    def _accept(self) -> None:
        now = time.monotonic()
        for _ in range(256):  # then let the others be served
            try:
                sock, addr = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, or closing: try again later
                return
            ip = addr[0]
            if len(self.conns) >= self.max_conns or self._pending[ip] >= self.max_pending:
                why = (
                    "too many connections"
                    if len(self.conns) >= self.max_conns
                    else (
                        f"{self.max_pending} connections from this address still in their handshake"
                    )
                )
                self.refusals.refused(ip, f"{ip}:{addr[1]}", why, now)
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = LoopConn(self, sock, addr, now)
            self.conns.add(conn)
            self._pending[ip] += 1
            self._timed.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._dirty.add(conn)

    def _read(self, conn: LoopConn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, f"connection error ({e.strerror or e})")
            return
        if not data:
            if conn.channel is None and not conn.inbuf and not conn.authenticated:
                self._drop(conn, "closed before its hello")  # a port probe: nothing to log
            else:
                self._lost(conn, PEER_CLOSED)
            return
        if conn.closing:
            return  # its last words are on their way; what it says now changes nothing
        conn.inbuf += data
        self._frames(conn)

    def _frames(self, conn: LoopConn) -> None:
        buf = conn.inbuf
        while len(buf) >= 4 and not (conn.closing or conn.closed):
            n = frame_length(bytes(buf[:4]))
            if conn.channel is None:
                cap = HELLO_MAX
            else:
                cap = MAX_FRAME if conn.authenticated else FIRST_MAX
            if n > cap:
                when = "" if conn.authenticated else " before authentication"
                self._refuse(conn, f"frame of {n} bytes exceeds the {cap}-byte limit{when}")
                return
            if len(buf) < 4 + n:
                return
            payload = bytes(buf[4 : 4 + n])
            del buf[: 4 + n]
            self._frame(conn, payload)

    def _frame(self, conn: LoopConn, payload: bytes) -> None:
        if conn.channel is None:
            try:
                conn.channel = server_channel(conn.sock, self.key, conn.nonce, payload)
            except MeshAuthError as e:
                self._refuse(conn, f"authentication failed: {e}")
            return
        try:
            msg = conn.channel.unpack(payload)
        except MeshAuthError as e:
            if not conn.authenticated:
                self._refuse(conn, f"authentication failed: {e}")
                return
            log.warning("refused message from %s: %s", conn.peer, e)
            conn.send({"type": "error", "error": f"refused: {e}"})
            self._end(conn, f"refused message: {e}")
            return
        if not conn.authenticated:
            conn.authenticated, conn.deadline = True, None
            self._pending[conn.ip] -= 1
            self._timed.discard(conn)
        try:
            with self.handler.lock:
                self.handler.on_message(conn, msg)
        except MeshAuthError as e:  # the handler refused it: closed after its answer
            self._end(conn, str(e))
        except Exception:  # a bug or malformed fields from an authenticated peer: drop only it
            log.exception("closing the connection from %s after an error", conn.peer)
            self._end(conn, "error")

    def _refuse(self, conn: LoopConn, reason: str) -> None:
        """Refuse a peer that has not authenticated: an unsigned refusal, then close."""
        self.refusals.refused(conn.ip, conn.peer, reason, time.monotonic())
        conn.queue(frame_bytes(msgpack.packb({"error": reason})))
        conn.close_after_flush()

    def _end(self, conn: LoopConn, why: str) -> None:
        """Close `conn` once its answers are written, telling the handler at once."""
        conn.close_after_flush()
        with self.handler.lock:
            self.handler.on_close(conn, why)

    def _lost(self, conn: LoopConn, why: str) -> None:
        if not conn.authenticated and not conn.closing:
            self.refusals.refused(
                conn.ip, conn.peer, f"{why} during the handshake", time.monotonic()
            )
        self._drop(conn, why)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._timed if c.deadline is not None and now >= c.deadline]:
            if conn.closing:
                self._drop(conn, "did not read its last messages")
            else:
                self._lost(conn, f"handshake not completed within {self.handshake_s:g} s")

    # ---- writing -------------------------------------------------------------------------
    def _settle(self) -> None:
        """Write what was queued; drop the connections whose queue overflowed."""
        while self._overflowed:
            conn = self._overflowed.pop()
            if not conn.closed:
                self._drop(
                    conn,
                    f"its send queue is full ({len(conn.out)} bytes unsent): "
                    "it does not read (stopped, or cut off)",
                )
        dirty, self._dirty = self._dirty, set()
        for conn in dirty:
            if not conn.closed:
                self._flush(conn)

    def _flush(self, conn: LoopConn) -> None:
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                self._drop(conn, f"connection error ({e.strerror or e})")
                return
            del conn.out[:sent]
        if not conn.out and conn.closing:
            self._drop(conn, "closed after its last messages", notify=conn.node is not None)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if self._sel.get_key(conn.sock).events != events:
            self._sel.modify(conn.sock, events, conn)

    def _drop(self, conn: LoopConn, why: str, notify: bool = True) -> None:
        """Close `conn` now; the handler hears of it (`notify`)."""
        if conn.closed:
            return
        conn.closed = True
        self.conns.discard(conn)
        self._timed.discard(conn)
        self._dirty.discard(conn)
        if not conn.authenticated:
            self._pending[conn.ip] -= 1
            if self._pending[conn.ip] <= 0:
                del self._pending[conn.ip]
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
        if notify and not self._stopping:
            with self.handler.lock:
                self.handler.on_close(conn, why)
