"""A node's connection to the coordinator: requests, pushed events and heartbeats.

Heartbeats run in their own thread so they keep going while the main thread computes (torch
releases the GIL in its kernels). The connection itself is the liveness signal both ways: the
coordinator evicts a node whose socket closes, and a node declares the coordinator lost when
its socket closes or nothing has arrived for `heartbeat_timeout` seconds.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from prime_mesh.errors import (
    CoordinatorLost,
    CoordinatorUnreachable,
    MeshAuthError,
    MeshError,
    MeshEvicted,
    MeshNameTaken,
    MeshRefused,
    MeshTimeout,
    RunCompleted,
)
from prime_mesh.progress import MAX_PENDING
from prime_mesh.wire import client_handshake, parse_address


class CoordinatorClient:
    def __init__(
        self,
        address: str,
        key: bytes,
        *,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        connect_timeout: float = 10.0,
        on_message: Callable[[dict], None] | None = None,
    ) -> None:
        self.address = address
        self.coordinator_host, port = parse_address(address)
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.on_message = on_message
        try:
            sock = socket.create_connection((self.coordinator_host, port), timeout=connect_timeout)
        except OSError as e:
            raise CoordinatorUnreachable(
                f"cannot reach the coordinator at {address} ({e.strerror or e}); check the address "
                "and that `prime-mesh coordinator` (or the trainer hosting it) is running"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.channel = client_handshake(sock, key)
        except (OSError, ConnectionError) as e:
            sock.close()
            raise CoordinatorLost(
                f"the coordinator at {address} did not complete the handshake ({e})"
            ) from None
        except MeshAuthError:
            sock.close()
            raise
        sock.settimeout(None)
        # Sends time out (a kernel send timeout, so reads still block): a coordinator that
        # stopped reading must not hold the send lock, and with it every request of this
        # node, for longer than it takes to declare the coordinator lost.
        sec = max(heartbeat_timeout, 0.001)
        sock.setsockopt(
            socket.SOL_SOCKET,
            socket.SO_SNDTIMEO,
            struct.pack("ll", int(sec), int((sec - int(sec)) * 1e6)),
        )
        self.local_host = sock.getsockname()[0]
        self._cond = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._next_id = 0
        self._error: tuple[type[MeshError], str] | None = None
        self._closing = False
        self._last_rx = time.monotonic()
        self._reader = threading.Thread(target=self._read_loop, name="mesh-reader", daemon=True)
        self._reader.start()
        self._beater: threading.Thread | None = None
        self._progress: deque[dict] = deque(maxlen=MAX_PENDING)  # for the next heartbeat

    # ---- state ---------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the error that ended this connection, if any."""
        err = self._error
        if err is not None:
            raise err[0](err[1])

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _fail(self, cls: type[MeshError], message: str) -> None:
        with self._cond:
            if self._error is None and not (self._closing and cls is CoordinatorLost):
                self._error = (cls, message)
            self._cond.notify_all()

    # ---- requests ------------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        self.check()
        try:
            self.channel.send(msg)
        except OSError as e:
            if not self._closing:
                self.wait_for(lambda: False, 1.0)  # time for the reader to read an eviction notice
            self._send_failed(e)
            self.check()
            raise

    def _send_failed(self, e: OSError) -> None:
        """A send failed or timed out: a frame may be cut short, so the stream is over."""
        what = "sending timed out" if isinstance(e, BlockingIOError | TimeoutError) else str(e)
        self._fail(CoordinatorLost, f"lost the coordinator at {self.address}: {what}")
        self.channel.close()

    def leave(self, completed: bool = False) -> None:
        """Tell the coordinator this node leaves the run (`completed`: it finished it). Best
        effort: over a lost connection it does nothing, and the coordinator drops the node
        when its heartbeats stop."""
        if self.failed:
            return
        try:
            self.channel.send({"type": "leave", "completed": completed})
        except OSError:
            pass

    def request(
        self, msg: dict, timeout: float | None = None, what: str = "the coordinator"
    ) -> dict:
        """Send `msg` and wait for its reply; raises the connection's error instead of hanging,
        and MeshTimeout after `timeout` seconds (None: as long as the connection lives)."""
        with self._cond:
            self._next_id += 1
            req = self._next_id
        self.send({**msg, "id": req})
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while req not in self._replies and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise MeshTimeout(f"timed out after {timeout:.1f}s waiting for {what}")
                self._cond.wait(left if left is not None else 1.0)
            reply = self._replies.pop(req, None)
        if reply is None:
            self.check()
        assert reply is not None
        if "error" in reply:
            kind = reply.get("kind")
            cls = {
                "refused": MeshRefused,
                "rejoin": MeshEvicted,
                "name_taken": MeshNameTaken,
                "completed": RunCompleted,
            }.get(kind, MeshError)
            raise cls(f"coordinator at {self.address} refused: {reply['error']}")
        return reply

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until predicate() (checked under the lock on every message) or the connection fails."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not predicate():
                if self._error is not None:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(min(left, 1.0) if left is not None else 1.0)
            return True

    def notify(self) -> None:
        """Wake every wait_for() so it re-checks its predicate."""
        with self._cond:
            self._cond.notify_all()

    def queue_progress(self, numbers: dict) -> None:
        """Send `numbers` (validated) with the next heartbeat."""
        self._progress.append(numbers)

    # ---- threads -------------------------------------------------------------------------
    def start_heartbeats(self) -> None:
        self._beater = threading.Thread(target=self._beat_loop, name="mesh-heartbeat", daemon=True)
        self._beater.start()

    def _beat_loop(self) -> None:
        last = time.monotonic()
        while not self._closing and self._error is None:
            beat: dict = {"type": "hb"}
            if self._progress:
                reports = []
                while self._progress:
                    reports.append(self._progress.popleft())
                beat["progress"] = reports
            try:
                self.channel.send(beat)
            except OSError as e:
                self._send_failed(e)
                return
            now = time.monotonic()
            if now - last > self.heartbeat_interval + self.heartbeat_timeout / 2:
                # This process was stalled (SIGSTOP, swap): what the coordinator sent meanwhile
                # is still unread, so judge its silence from now, not from before the stall.
                with self._cond:
                    self._last_rx = max(self._last_rx, now)
            last = now
            silent = now - self._last_rx
            if silent > self.heartbeat_timeout:
                self._fail(
                    CoordinatorLost,
                    f"the coordinator at {self.address} has not answered for {silent:.1f}s "
                    f"(heartbeat timeout {self.heartbeat_timeout:g}s)",
                )
                self.channel.close()
                return
            time.sleep(self.heartbeat_interval)

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self.channel.recv()
            except MeshAuthError as e:
                self._fail(
                    MeshAuthError,
                    f"{e}; check that PRIME_TOKEN (or token=) matches the coordinator's at {self.address}",
                )
                return
            except (OSError, ConnectionError):
                self._fail(
                    CoordinatorLost,
                    f"lost the coordinator at {self.address}: connection closed (it stopped or "
                    "restarted); membership can no longer change: restart the coordinator and the nodes",
                )
                return
            kind = msg.get("type")
            with self._cond:
                self._last_rx = time.monotonic()
                if kind == "reply":
                    self._replies[int(msg.get("id", 0))] = msg
                elif kind == "evicted":  # more precise than a CoordinatorLost seen first
                    self._error = (
                        MeshEvicted,
                        f"this node ({msg.get('node_id')}) was evicted from the run: "
                        f"{msg.get('reason')}. It must not use its old group; close() this mesh "
                        "and create a new ElasticDeviceMesh to rejoin as a new member",
                    )
                elif kind == "error":
                    self._error = self._error or (MeshAuthError, str(msg.get("error")))
                elif self.on_message is not None:
                    self.on_message(msg)
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.channel.close()
        self._reader.join(timeout=2)
        if self._beater is not None:
            self._beater.join(timeout=2)
