"""Token buckets: a donor's upload cap (`RateLimit`), and a fetch's pace that a joiner can also
hold while its own collective needs the link (`LinkGate`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

HOLD_MAX_S = 10.0  # the longest a held fetch waits per read (a donor drops a silent reader)


class _Bucket:
    """`bytes_per_s` shared by every caller: `_reserve(n)` books n bytes, returns the wait."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()  # when the next read may start

    def _reserve(self, n: int) -> float:
        assert self.rate
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
        return start - now


class RateLimit(_Bucket):
    """A token bucket shared by all connections (keeps a donor's uplink usable for training)."""

    def __init__(self, bytes_per_s: float, closing: threading.Event) -> None:
        super().__init__(float(bytes_per_s))
        self._closing = closing

    def take(self, n: int) -> None:
        wait = self._reserve(n)
        if wait > 0 and self._closing.wait(wait):
            raise ConnectionAbortedError("server closing")


class LinkGate(_Bucket):
    """`fetch_checkpoint`'s `pace` (pass `gate.wait`) for a fetch that shares its link with
    the fetching node's own collectives: while the node holds the gate (`held`) the fetch's
    reads wait (each at most `HOLD_MAX_S`); otherwise they keep to `bytes_per_s` (None: no
    cap), one bucket for every connection. A paced fetch reads little at a time with a small
    receive window, so its donors stop sending within a fraction of a second of a hold."""

    def __init__(self, bytes_per_s: float | None = None) -> None:
        super().__init__(bytes_per_s)
        self._open = threading.Event()
        self._open.set()
        self.held_seconds = 0.0  # held so far, in all

    def wait(self, n: int) -> None:
        """Before each read of `n` bytes: wait while the gate is held, then for the cap."""
        self._open.wait(HOLD_MAX_S)
        if self.rate and (wait := self._reserve(n)) > 0:
            time.sleep(wait)

    @contextmanager
    def held(self) -> Iterator[None]:
        """The node's collective runs: the fetch waits."""
        self._open.clear()
        t = time.monotonic()
        try:
            yield
        finally:
            self._open.set()
            self.held_seconds += time.monotonic() - t
            with self._lock:  # no burst to make up for the time held
                self._next = max(self._next, time.monotonic())
