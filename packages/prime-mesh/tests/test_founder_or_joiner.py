"""Founder or joiner, decided by the coordinator at registration ("auto"); a completed run."""

import pytest

from prime_mesh.membership import Membership
from prime_mesh.reform import Completed
from prime_testkit import FakeConn


def _register(m: Membership, key: str, lr: int = 0, lws: int = 2, ready="auto", cfg="h1"):
    msg = {"node_key": key, "local_rank": lr, "local_world_size": lws, "ready": ready,
           "metadata": {"k": key, "config_hash": cfg}}  # fmt: skip
    conn = FakeConn()
    return m.register(conn, msg), conn


def sync_all(m: Membership, nodes, conn) -> None:
    for node in nodes:
        for lr in (0, 1):
            m.sync(node, lr, conn, 1, {"epoch": m.epoch, "admit": True})


def test_auto_nodes_found_the_run_until_it_has_members_then_wait_as_joiners():
    m = Membership(min_nodes=2)
    for key in ("a", "b"):  # nodes of two ranks each
        for lr in (0, 1):
            _register(m, key, lr=lr)
    a, b = m.nodes["a"], m.nodes["b"]
    ca = cb = FakeConn()
    assert not a.joining and not b.joining and m.epoch == 1 and m.members == ["a", "b"]
    # the run has members: a node of two ranks is one joiner, whichever rank comes first
    c1, _ = _register(m, "c", lr=1, lws=2)
    c0, _ = _register(m, "c", lr=0, lws=2)
    assert c0 is c1 and c0.joining and not c0.ready
    sync_all(m, [a, b], ca)
    assert m.epoch == 1  # waiting: never admitted before it says ready
    m.ready(c0, 0)
    m.ready(c0, 1)
    sync_all(m, [a, b], cb)
    assert m.epoch == 2 and "c" in m.members


def test_a_node_registering_after_the_run_completed_is_told_so():
    m = Membership(min_nodes=1)
    a, _ = _register(m, "a", lws=1)
    assert m.members == ["a"]
    m.leave(a, completed=True)
    assert m.status()["completed"]
    with pytest.raises(Completed, match="complete"):
        _register(m, "b", lws=1)
    # another config (a new run, say with more steps) is not that run: it founds its own
    c, _ = _register(m, "c", lws=1, cfg="h2")
    assert not c.joining and m.members == ["c"]


def test_a_member_leaving_without_completing_does_not_mark_the_run_complete():
    m = Membership(min_nodes=1)
    a, _ = _register(m, "a", lws=1)
    m.leave(a, completed=False)
    assert not m.status()["completed"]
    b, _ = _register(m, "b", lws=1)
    assert not b.joining and m.members == ["b"]


def test_a_joiner_left_waiting_when_every_member_left_is_no_founder():
    """Every member left while a node waited to join (churn seed 5); two of them register
    again: they form the run and the joiner, which holds no state to found one with, is
    admitted at their first sync point. It counts towards min_nodes."""
    m = Membership(min_nodes=3)
    nodes = {k: _register(m, k, lws=1) for k in "abc"}
    assert m.epoch == 1
    joiner, _ = _register(m, "j", lws=1)  # the run has members: it joins
    m.ready(joiner, 0)
    for key in "abc":
        m.leave(nodes[key][0], completed=False)
    assert not m.members and joiner.joining
    a2, ca = _register(m, "a2", lws=1)  # the run has no member: founders
    assert not m.members, "one founder and one joiner: below min_nodes"
    b2, cb = _register(m, "b2", lws=1)
    assert m.members == ["a2", "b2"], "formed by the founders alone"
    for node, conn in ((a2, ca), (b2, cb)):
        m.sync(node, 0, conn, 1, {"epoch": m.epoch, "admit": True})
    assert m.members == ["a2", "b2", "j"], "admitted at their first sync point"
