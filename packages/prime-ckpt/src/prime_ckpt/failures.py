"""Background failures of one manager: a disk save or an upload that failed for good.

Each failure is logged once, at ERROR, on the `prime_ckpt` logger (one line; retries before
it are INFO), counted, kept (the newest `KEPT`), and handed to the manager's `on_error`
callback if it has one. Without a callback, a failed disk save not yet reported by its
handle's `wait()` is raised by the manager's `wait()` or warned at the next `save()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("prime_ckpt")
KEPT = 100


@dataclass(frozen=True)
class CheckpointFailure:
    """A checkpoint that did not reach a tier: `tier` is "disk" (the save failed) or
    "remote" (its upload failed after every retry); `message` says why and what is intact."""

    step: int
    tier: str
    message: str
    time: float = field(default_factory=time.time)


class Failures:
    """Counts, keeps and reports background failures (see the module doc)."""

    def __init__(self, on_error: Callable[[CheckpointFailure], None] | None = None) -> None:
        self.on_error = on_error
        self.count = 0
        self.kept: deque[CheckpointFailure] = deque(maxlen=KEPT)
        self.unreported: list[CheckpointFailure] = []  # disk failures nobody was told of yet
        self.lock = threading.Lock()

    def add(self, step: int, tier: str, message: str) -> None:
        """Record a failure (called by the background thread that met it)."""
        message = " ".join(message.splitlines())  # one line, whatever the cause said
        failure = CheckpointFailure(step, tier, message)
        log.error("prime-ckpt: %s", message)
        with self.lock:
            self.count += 1
            self.kept.append(failure)
            if tier == "disk" and self.on_error is None:
                self.unreported.append(failure)
        if self.on_error is not None:
            try:
                self.on_error(failure)
            except Exception:  # the background thread must go on
                log.exception("prime-ckpt: the on_error callback raised")

    def reported(self, step: int) -> None:
        """A handle's `wait()` raised the failure of `step`."""
        with self.lock:
            self.unreported = [f for f in self.unreported if f.step != step]

    def recent(self) -> list[CheckpointFailure]:
        with self.lock:
            return list(self.kept)

    def take_unreported(self) -> list[CheckpointFailure]:
        with self.lock:
            out, self.unreported = self.unreported, []
        return out
