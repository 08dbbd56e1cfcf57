"""Waiter: a work that finishes just as a wait slice runs out is not a failed collective."""

import pytest

from prime_comm import CollectiveAborted
from prime_comm._wait import Waiter


class RacyWork:
    """gloo's Work as seen in the race: the timed wait raised "Operation timed out!", and by
    the time is_completed() is asked the collective has finished (ok or with its own error)."""

    def __init__(self, error: str | None = None):
        self.error, self.timed_waits = error, 0

    def wait(self, timeout=None):
        if timeout is not None and self.timed_waits == 0:
            self.timed_waits += 1
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self):
        return self.timed_waits > 0


def test_work_finishing_as_the_slice_runs_out_succeeds():
    Waiter(10.0, None, "all_reduce").wait(RacyWork(), "piece 0")


def test_work_that_failed_reports_its_own_error():
    with pytest.raises(CollectiveAborted, match="Connection closed by peer"):
        Waiter(10.0, None, "all_reduce").wait(RacyWork("Connection closed by peer"), "piece 0")
