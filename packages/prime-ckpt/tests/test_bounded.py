"""A remote that hangs costs one bound, not one per listing (`prime_ckpt.bounded.Breaker`):
a node's start lists its remote prefix three to five times, each bounded by 60 s."""

import threading

import pytest

from prime_ckpt.bounded import Breaker


def test_a_call_that_hung_is_not_made_again_until_the_quiet_time_passed():
    now = [0.0]
    breaker = Breaker(quiet_s=300.0, clock=lambda: now[0])
    release, calls = threading.Event(), []

    def hangs() -> list[int]:
        calls.append(1)
        release.wait(10)  # (a remote that never answers; released at the end)
        return [1]

    try:
        with pytest.raises(TimeoutError, match="listing x took more than 0 s"):
            breaker.call(hangs, 0.2, "listing x")
        now[0] = 299.0
        with pytest.raises(TimeoutError, match="not asked again for 300 s"):
            breaker.call(hangs, 0.2, "listing x")
        assert len(calls) == 1, "the second call was made"
        now[0] = 301.0
        assert breaker.call(lambda: [7], 0.2, "listing x") == [7]  # asked again, answered
        with pytest.raises(KeyError):  # a failure (not only a hang) opens it too
            breaker.call(lambda: {}["missing"], 0.2, "listing x")
        with pytest.raises(TimeoutError, match="not asked again"):
            breaker.call(lambda: [7], 0.2, "listing x")
    finally:
        release.set()


def test_tripped_says_the_error_while_calls_fail_at_once():
    now = [0.0]
    breaker = Breaker(quiet_s=300.0, clock=lambda: now[0])
    assert breaker.tripped is None
    with pytest.raises(KeyError):
        breaker.call(lambda: {}["missing"], 0.2, "listing x")
    assert isinstance(breaker.tripped, KeyError)
    now[0] = 301.0
    assert breaker.tripped is None  # asked again from now on
