"""Founder or joiner, decided by the coordinator at registration ("auto"); a completed run."""

from functools import partial

import pytest

from prime_mesh.membership import Membership
from prime_mesh.reform import Completed
from prime_testkit import FakeConn, register, sync_all

# this file's nodes register with ready="auto" and config hash "h1", of two ranks by default
_register = partial(register, lws=2, ready="auto", cfg="h1")


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
    sync_all(m, [(a, ca), (b, ca)], local_ranks=(0, 1))
    assert m.epoch == 1  # waiting: never admitted before it says ready
    m.ready(c0, 0)
    m.ready(c0, 1)
    sync_all(m, [(a, cb), (b, cb)], local_ranks=(0, 1))
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


def test_nodes_joining_a_run_whose_every_member_left_are_told_to_register_again():
    """Every member left while nodes waited to join (churn seeds 5 and 21): nobody is left to
    hand them the run's state, so each is evicted, told why, and registering again makes it
    a founder; the run forms anew once `min_nodes` founders are back (the trainer then
    resumes from the newest state any of them holds)."""
    m = Membership(min_nodes=3)
    nodes = {k: _register(m, k, lws=1) for k in "abc"}
    assert m.epoch == 1
    joiners = {k: _register(m, k, lws=1) for k in ("j", "k")}  # the run has members: joiners
    m.ready(joiners["j"][0], 0)  # one is ready (queued), the other still fetching (waiting)
    assert joiners["j"][0].joining and joiners["k"][0].joining
    m.leave(nodes["a"][0], completed=False)
    m.leave(nodes["b"][0], completed=False)
    assert set(m.nodes) == {"c", "j", "k"}, "members are left: the joiners stay"
    m.leave(nodes["c"][0], completed=False)
    assert not m.members and not m.nodes, "nobody to join: both joiners evicted"
    for key, (_, conn) in joiners.items():
        told = [x for x in conn.sent if x.get("type") == "evicted"]
        assert len(told) == 1 and "no members left" in told[0]["reason"], (key, conn.sent)
    a2, _ = _register(m, "a2", lws=1)
    j2, _ = _register(m, "j2", lws=1)  # registering again: the run has no member, a founder
    assert not j2.joining and not m.members, "two founders: below min_nodes"
    k2, _ = _register(m, "k2", lws=1)
    assert not k2.joining and m.members == ["a2", "j2", "k2"], "formed by all three"


def test_a_completed_run_tells_its_joiners_so_rather_than_to_register_again():
    m = Membership(min_nodes=1)
    a, _ = _register(m, "a", lws=1)
    j, cj = _register(m, "j", lws=1)
    m.leave(a, completed=True)
    assert "j" in m.nodes and not [x for x in cj.sent if x.get("type") == "evicted"]
