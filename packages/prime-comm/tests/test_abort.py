"""Abort paths: should_abort, a deadline while one rank stalls, a peer that dies.

Each case runs in a fresh gloo group (an aborted group may hold pending collectives), and
every bound below is loose: it proves the path releases the caller, not how fast.
"""

from __future__ import annotations

import time

import pytest


@pytest.mark.parametrize("mode", ["should_abort", "deadline", "deadline_timedelta"])
def test_stalled_rank_releases_the_others(pool4, mode):
    group = pool4.fresh_group()
    replies = pool4.run("abort", 3, group=group, mode=mode, stall_rank=2, after=0.5, stall=1.5)
    expected = "should_abort" if mode == "should_abort" else "timeout"
    for r in replies[:2]:
        assert r["raised"] == "CollectiveAborted" and r["reason"] == expected, r
        assert 0.4 <= r["elapsed"] <= 10.0, r  # raised once the condition held
    # The late rank finds its peers gone and is released by its own 1 s deadline.
    assert replies[2]["raised"] == "CollectiveAborted" and replies[2]["reason"] == "timeout"
    assert replies[2]["elapsed"] <= 10.0


def test_abort_in_the_middle_of_the_pipeline(pool4):
    group = pool4.fresh_group()
    replies = pool4.run("abort_midway", 3, group=group, abort_rank=1, calls=4)
    assert replies[1]["raised"] == "CollectiveAborted" and replies[1]["reason"] == "should_abort"
    for r in (replies[0], replies[2]):  # left waiting for rank 1: their 3 s deadline fires
        assert r["raised"] == "CollectiveAborted" and r["reason"] == "timeout", r
        assert r["elapsed"] <= 15.0


def test_work_goes_on_in_a_fresh_group_after_aborts(pool4):
    replies = pool4.run("reduce", 3, group=pool4.fresh_group(), n=100_000, seed=1)
    assert len({r["digest"] for r in replies}) == 1 and replies[0]["rel_err"] <= 0.02


def test_killed_peer_fails_the_collective_on_the_survivors(pool4, children):
    group = pool4.fresh_group()
    for rank in (0, 1):  # they join `group` with the bare peer below, then wait for it
        pool4.send(rank, "abort", 3, group=group, mode="deadline", stall_rank=2, after=20.0)
    peer = pool4.bare_peer(children, 2, 3, group)
    time.sleep(0.5)
    peer.kill()
    peer.wait(timeout=30)
    replies = [pool4.reply(rank, timeout=60) for rank in (0, 1)]
    for r in replies:
        assert r["raised"] == "CollectiveAborted", r
    assert any(r["reason"] == "peer_failure" for r in replies), replies
    assert min(r["elapsed"] for r in replies) < 19.0, replies
