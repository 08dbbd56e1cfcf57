"""A donor's upload cap: one token bucket shared by all its connections."""

from __future__ import annotations

import threading
import time


class RateLimit:
    """A token bucket shared by all connections (keeps a donor's uplink usable for training)."""

    def __init__(self, bytes_per_s: float, closing: threading.Event) -> None:
        self.rate = float(bytes_per_s)
        self._closing = closing
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            wait = start - now
        if wait > 0 and self._closing.wait(wait):
            raise ConnectionAbortedError("server closing")
