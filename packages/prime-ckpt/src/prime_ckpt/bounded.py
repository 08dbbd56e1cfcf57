"""Calls to a remote store given a bound: a remote that hangs must not hang a start or a stop,
and one that hung once is not waited for again at every call (`Breaker`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

QUIET_S = 300.0  # after a listing failed or hung, the next ones fail at once for this long


def bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """`fn()` on a helper thread, given at most `timeout` s (a remote that hangs must not
    hang a start or a stop); TimeoutError naming `what` after that (the thread is left)."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:
            box.append((False, e))

    t = threading.Thread(target=run, name="prime-ckpt-bounded", daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise TimeoutError(f"{what} took more than {timeout:.0f} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


class Breaker:
    """`bounded` calls that, once one failed or passed its bound, fail at once with that
    error for `quiet_s`: a remote that hangs costs a start one bound, not one per listing
    (a start lists a node's prefix three to five times)."""

    def __init__(self, quiet_s: float = QUIET_S, clock: Callable[[], float] = time.monotonic):
        self.quiet_s, self.clock = quiet_s, clock
        self._lock = threading.Lock()
        self._until, self._error = 0.0, None

    @property
    def tripped(self) -> Exception | None:
        """The error the calls fail with at once for now, or None: they are made."""
        with self._lock:
            return self._error if self.clock() < self._until else None

    def call(self, fn: Callable[[], T], timeout: float, what: str) -> T:
        error = self.tripped
        if error is not None:
            raise TimeoutError(f"{error} (not asked again for {self.quiet_s:.0f} s)")
        try:
            return bounded(fn, timeout, what)
        except Exception as e:
            with self._lock:
                self._until, self._error = self.clock() + self.quiet_s, e
            raise
