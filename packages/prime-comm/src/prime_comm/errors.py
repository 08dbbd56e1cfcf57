"""Exceptions raised by prime_comm collectives."""

from __future__ import annotations


class CollectiveAborted(RuntimeError):
    """A collective gave up: its deadline passed, `should_abort()` turned true, or a peer failed.

    `reason` is "timeout", "should_abort" or "peer_failure". After this the process group may
    be unusable (collectives may still be pending inside it): rebuild it before the next call.
    The tensor passed in holds partial results and must not be used.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
