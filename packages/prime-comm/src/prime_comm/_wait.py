"""Bounded, abortable waits on torch.distributed Work objects.

A gloo collective blocked on a peer that never arrives is not released by `pg.abort()`, but
`work.wait(timeout)` returns control after the timeout while the work stays pending. So every
wait here is a loop of short slices, checking the deadline and `should_abort()` in between.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import timedelta

from prime_comm.errors import CollectiveAborted

SLICE_SECONDS = 0.25


def parse_timeout(timeout: object) -> float | None:
    """Seconds from None, a number or a timedelta; raise a clear error for anything else."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"timeout must be seconds (int or float), a timedelta or None, "
            f"got {type(timeout).__name__}"
        )
    else:
        seconds = float(timeout)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return None if math.isinf(seconds) else seconds


class Waiter:
    """Deadline plus abort check shared by every wait of one collective call."""

    def __init__(
        self, timeout_s: float | None, should_abort: Callable[[], bool] | None, what: str
    ) -> None:
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.should_abort = should_abort
        self.what = what

    def check(self) -> None:
        """Raise CollectiveAborted if the call must stop now."""
        if self.should_abort is not None and self.should_abort():
            raise CollectiveAborted(
                f"{self.what} aborted: should_abort() returned True", "should_abort"
            )
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise CollectiveAborted(
                f"{self.what} timed out after {self.timeout_s:g} s "
                "(a peer is stalled, slow or gone)",
                "timeout",
            )

    def issue(self, start: Callable[[], object], step: str):
        """Start a collective; a group that refuses (broken by an earlier failure) aborts."""
        self.check()
        try:
            return start()
        except RuntimeError as e:
            raise CollectiveAborted(
                f"{self.what} could not start {step}: {e}", "peer_failure"
            ) from e

    def wait(self, work, step: str) -> None:
        """Wait for `work` in slices of at most SLICE_SECONDS; raise CollectiveAborted on abort."""
        while True:
            self.check()
            slice_s = SLICE_SECONDS
            if self.deadline is not None:
                slice_s = max(0.001, min(slice_s, self.deadline - time.monotonic()))
            try:
                work.wait(timedelta(seconds=slice_s))
                return
            except RuntimeError:
                # A slice that ran out leaves the work pending. The work may also have
                # finished just after the slice ran out: then this slice's "timed out" says
                # nothing, and only the work's own outcome counts (below).
                if not work.is_completed():
                    continue
            try:
                work.wait()  # finished: returns at once, or raises the collective's own error
                return
            except RuntimeError as e:  # the collective itself failed (e.g. a peer closed)
                raise CollectiveAborted(
                    f"{self.what} failed during {step}: {e}", "peer_failure"
                ) from e
