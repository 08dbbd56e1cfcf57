"""Late members at a sync point or vote: the coordinator's state machine with a fake clock.

A member stuck while it heartbeats is left out (evicted) once the first member has waited the
sync timeout; the others are answered with one new epoch without it. With no timeout asked
(auto), the limit follows the recent arrival spread (see prime_mesh.barrier).
"""

import pytest

from prime_mesh.barrier import AUTO_CEILING_S, AUTO_FACTOR, AUTO_FLOOR_S, SyncWaits
from prime_mesh.membership import Membership
from prime_testkit import FakeClock, FakeConn, form


def _beat(m: Membership, clock: FakeClock, nodes, seconds: float) -> None:
    """`seconds` pass with every node heartbeating, the coordinator ticking."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + 0.5)
        for node, _ in nodes.values():
            if m.nodes.get(node.key) is node:
                m.heartbeat(node, 0)
        m.tick()


def _sync(m: Membership, node_conn, req: int = 7) -> None:
    node, conn = node_conn
    m.sync(node, 0, conn, req, {"epoch": m.epoch, "admit": True})


def test_a_member_stuck_before_the_sync_point_is_left_out_after_the_timeout():
    clock = FakeClock()
    m = Membership(min_nodes=3, clock=clock)
    n = form(m, list("abc"), sync_timeout=5.0)
    _sync(m, n["a"])
    _beat(m, clock, n, 2.0)
    _sync(m, n["b"])
    _beat(m, clock, n, 2.5)  # 4.5 s since "a" arrived: still waited for
    assert m.epoch == 1 and not n["a"][1].replies(7)
    _beat(m, clock, n, 1.0)
    # "c" heartbeats on, but is evicted as late; the two are answered with one new epoch
    assert m.epoch == 2 and [m.nodes[k].node_id for k in m.members] == [
        n["a"][0].node_id,
        n["b"][0].node_id,
    ]
    for k in "ab":
        (reply,) = n[k][1].replies(7)
        assert reply["epoch"]["epoch"] == 2
    evicted = [x for x in n["c"][1].sent if x.get("type") == "evicted"]
    assert evicted and "did not reach the sync point within 5.0s" in evicted[0]["reason"]
    assert n["c"][1].closed
    assert m.history.events[-1]["kind"] == "evicted"
    # the next sync point has no clock running over from the last one
    _beat(m, clock, n, 10.0)
    assert m.epoch == 2
    _sync(m, n["a"], 8)
    _sync(m, n["b"], 8)
    assert n["a"][1].replies(8)[0]["epoch"]["epoch"] == 2


def test_a_listener_arriving_a_round_early_does_not_start_the_clock():
    clock = FakeClock()
    m = Membership(min_nodes=3, clock=clock)
    n = form(m, list("abc"), sync_timeout=5.0)
    node, conn = n["c"]  # a listening joiner: at the sync point long before the others
    m.sync(node, 0, conn, 7, {"epoch": m.epoch, "admit": True, "listening": True})
    _beat(m, clock, n, 20.0)
    assert m.epoch == 1 and len(m.members) == 3  # nobody left out for its early arrival
    _sync(m, n["a"])  # the first member starts the clock
    _beat(m, clock, n, 2.0)
    _sync(m, n["b"])
    for k in "abc":
        assert n[k][1].replies(7)[0]["epoch"]["epoch"] == 1


def test_several_late_members_leave_in_one_epoch():
    clock = FakeClock()
    m = Membership(min_nodes=4, clock=clock)
    n = form(m, list("abcd"), sync_timeout=3.0)
    _sync(m, n["a"])
    _beat(m, clock, n, 3.5)
    assert m.epoch == 2 and len(m.members) == 1
    (reply,) = n["a"][1].replies(7)
    assert reply["epoch"]["members"] == [n["a"][0].node_id]


def test_a_member_that_does_not_vote_is_left_out_and_the_vote_fails():
    clock = FakeClock()
    m = Membership(min_nodes=3, clock=clock)
    n = form(m, list("abc"), sync_timeout=4.0)
    for k in "abc":
        _sync(m, n[k])
    for k in "ab":
        node, conn = n[k]
        m.vote(node, 0, conn, 9, {"epoch": 1, "seq": 0, "ok": True})
    _beat(m, clock, n, 3.5)
    assert not n["a"][1].replies(9)
    _beat(m, clock, n, 1.0)
    assert m.epoch == 2 and len(m.members) == 2
    for k in "ab":
        (reply,) = n[k][1].replies(9)
        assert reply["result"] is False  # not committed: the round is retried without "c"
    reason = [x for x in n["c"][1].sent if x.get("type") == "evicted"][0]["reason"]
    assert "did not reach the vote" in reason


def test_an_even_run_is_never_cut_short():
    clock = FakeClock()
    m = Membership(min_nodes=3, clock=clock)
    n = form(m, list("abc"))  # auto
    for _ in range(20):  # rounds of 60 s; arrivals spread over 2 s
        _beat(m, clock, n, 60.0)
        for i, k in enumerate("abc"):
            _sync(m, n[k])
            _beat(m, clock, n, 1.0 if i < 2 else 0.0)
        for k in "abc":
            node, conn = n[k]
            m.vote(node, 0, conn, 9, {"epoch": m.epoch, "seq": 0, "ok": True})
    assert m.epoch == 1 and len(m.members) == 3
    assert m.waits.limit([None]) == AUTO_FLOOR_S


def test_the_auto_limit_follows_the_arrival_spread_within_its_bounds():
    w = SyncWaits()
    assert w.limit([None, None]) == AUTO_FLOOR_S  # no sync point seen yet
    for spread in (1.0, 20.0, 2.0):
        w.arrived(100.0)
        w.completed(100.0 + spread)
    assert w.limit([None]) == AUTO_FACTOR * 20.0
    assert w.limit([None, 200.0]) == 200.0  # the largest a member asked for
    w.arrived(0.0)
    w.completed(1e5)
    assert w.limit([None]) == AUTO_CEILING_S
    for _ in range(8):  # the window forgets old spreads
        w.arrived(0.0)
        w.completed(0.5)
    assert w.limit([None]) == AUTO_FLOOR_S


@pytest.mark.parametrize("bad", [-1.0, "5", True, float("inf")])
def test_a_bad_sync_timeout_is_refused(bad):
    from prime_mesh.reform import Refused

    m = Membership()
    msg = {"node_key": "a", "local_rank": 0, "local_world_size": 1, "sync_timeout": bad}
    with pytest.raises(Refused, match="sync_timeout"):
        m.register(FakeConn(), msg)
