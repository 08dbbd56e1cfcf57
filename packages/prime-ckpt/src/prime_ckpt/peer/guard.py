"""What keeps a donor's connections from tying it up: caps on connections (per address and in
all), a deadline on each request's header as a whole (not per recv, so a client dripping one
byte at a time cannot hold a thread), a cap on a request header's bytes (what a signed GET
needs), and refusals logged at most once per address per minute (a flood must not flood the
log too).
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("prime_ckpt.peer")


@dataclass(frozen=True)
class Limits:
    """A donor's connection limits; see the module docstring."""

    max_connections: int = 64
    max_per_address: int = 16
    handshake_s: float = 10.0  # accept (or a request's first byte) to its whole header
    idle_s: float = 60.0  # an authenticated keep-alive connection waiting for its next request
    request_bytes: int = 16 << 10  # one request header: line + signed headers, with room

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_per_address, self.request_bytes) < 1:
            raise ValueError(f"connection limits must be >= 1, got {self}")
        if min(self.handshake_s, self.idle_s) <= 0:
            raise ValueError(f"handshake_s and idle_s must be > 0, got {self}")


class RefusalLog:
    """Logs a refusal at most once per address per `every_s` (counting the ones not shown)."""

    def __init__(self, every_s: float = 60.0) -> None:
        self._every = every_s
        self._last: dict[str, tuple[float, int]] = {}  # address -> (last logged, skipped since)
        self._lock = threading.Lock()

    def warn(self, address: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last, skipped = self._last.get(address, (-self._every, 0))
            if now - last < self._every:
                self._last[address] = (last, skipped + 1)
                return
            self._last[address] = (now, 0)
            if len(self._last) > 4096:  # many addresses: forget those quiet for a while
                cutoff = now - self._every
                self._last = {a: v for a, v in self._last.items() if v[0] >= cutoff}
        more = f" ({skipped} more from it not logged)" if skipped else ""
        log.warning("refused %s: %s%s", address, message, more)


class Admission:
    """Counts open connections per address; `admit` says whether one more may be served."""

    def __init__(self, limits: Limits, refusals: RefusalLog) -> None:
        self.limits = limits
        self._refusals = refusals
        self._open: dict[socket.socket, str] = {}
        self._per: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, conn: socket.socket, address: str) -> bool:
        with self._lock:
            if len(self._open) >= self.limits.max_connections:
                why = f"{len(self._open)} connections open, the donor's cap"
            elif self._per.get(address, 0) >= self.limits.max_per_address:
                why = f"{self._per[address]} connections open from this address, the cap"
            else:
                self._open[conn] = address
                self._per[address] = self._per.get(address, 0) + 1
                return True
        self._refusals.warn(address, f"connection: {why}")
        return False

    def release(self, conn: socket.socket) -> None:
        with self._lock:
            address = self._open.pop(conn, None)
            if address is not None:
                self._per[address] -= 1
                if not self._per[address]:
                    del self._per[address]

    @property
    def count(self) -> int:
        return len(self._open)


class HandshakeRefused(ConnectionAbortedError):
    """A request header that broke the limits (too slow, too large): the connection ends."""


class RequestReader(io.RawIOBase):
    """The raw side of a connection's `rfile`: each request header must arrive whole within
    `handshake_s` (from the accept for a connection's first request, else from its first
    byte) and within `request_bytes`; the body-less GETs a donor serves have nothing more."""

    def __init__(self, sock: socket.socket, limits: Limits) -> None:
        super().__init__()
        self._sock, self._limits = sock, limits
        self._deadline: float | None = time.monotonic() + limits.handshake_s
        self._budget: int | None = limits.request_bytes
        self.authenticated = False

    def readable(self) -> bool:
        return True

    def begin(self) -> None:
        """A request header is awaited: a fresh connection keeps the deadline of its accept;
        an authenticated one may idle first, then gets the deadline at its first byte."""
        self._budget = self._limits.request_bytes
        if self.authenticated:
            self._deadline = None
            self._sock.settimeout(self._limits.idle_s)

    def end(self) -> None:
        """The header is in: no deadline while the response is sent (per-send timeout)."""
        self._deadline = self._budget = None
        self._sock.settimeout(self._limits.idle_s)

    def readinto(self, b) -> int:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise HandshakeRefused(
                    f"request header not in within {self._limits.handshake_s:g} s"
                )
            self._sock.settimeout(left)
        view = memoryview(b)
        if self._budget is not None:
            if self._budget <= 0:
                raise HandshakeRefused(f"request header over {self._limits.request_bytes} bytes")
            view = view[: self._budget]
        try:
            n = self._sock.recv_into(view)
        except TimeoutError:
            if self._deadline is None:  # an idle keep-alive connection: the stdlib ends it
                raise
            raise HandshakeRefused(
                f"request header not in within {self._limits.handshake_s:g} s"
            ) from None
        if self._budget is not None:
            self._budget -= n
            if self._deadline is None and n:  # an idle connection's next request began
                self._deadline = time.monotonic() + self._limits.handshake_s
        return n
