"""The coordinator's state machine alone (no sockets): registering, waiting, joining, member."""

from prime_mesh.membership import Membership
from prime_testkit import FakeClock, register, sync_all


def states_by_key(m: Membership) -> dict[str, str]:
    """Each node's state by the key it registered with (`register`'s metadata)."""
    return {n["metadata"]["k"]: n["state"] for n in m.status()["nodes"]}


def test_waiting_nodes_neither_form_nor_join_until_ready():
    m = Membership(min_nodes=2)
    a, ca = register(m, "a", ready=False)
    b, cb = register(m, "b")
    # "b" is ready, "a" is not: min_nodes counts only ready nodes, so nothing forms
    assert m.epoch == 0 and states_by_key(m) == {"a": "waiting", "b": "joining"}
    m.ready(a, 0)
    assert m.epoch == 1 and states_by_key(m) == {"a": "member", "b": "member"}
    # the run forms in the order nodes became ready; no sync point admitted them
    assert m.epoch_info()["members"] == [b.node_id, a.node_id]
    assert m.epoch_info()["joined"] == []

    # a waiting node is visible (with its metadata) but sync points do not admit it
    c, cc = register(m, "c", ready=False)
    sync_all(m, [(a, ca), (b, cb)])
    assert m.epoch == 1 and states_by_key(m)["c"] == "waiting"
    assert next(n for n in m.status()["nodes"] if n["node_id"] == c.node_id)["metadata"] == {
        "k": "c"
    }
    m.ready(c, 0)
    m.ready(c, 0)  # twice is harmless
    assert m.epoch == 1 and states_by_key(m)["c"] == "joining"  # only at the next sync point
    sync_all(m, [(a, ca), (b, cb)])
    assert m.epoch == 2 and m.epoch_info()["members"][-1] == c.node_id
    assert m.epoch_info()["joined"] == [c.node_id]  # its first sync point is this one
    assert [msg for msg in cc.sent if msg.get("type") == "epoch"][-1]["epoch"]["epoch"] == 2


def test_a_node_that_never_opts_in_is_admitted_as_before():
    m = Membership(min_nodes=1)
    a, ca = register(m, "a")  # no "ready" field: an older client
    assert m.epoch == 1
    register(m, "b", ready=True)
    assert states_by_key(m)["b"] == "joining"
    sync_all(m, [(a, ca)])
    assert m.epoch == 2 and states_by_key(m) == {"a": "member", "b": "member"}


def test_every_local_rank_must_be_ready():
    m = Membership(min_nodes=1)
    a0, ca0 = register(m, "a", lr=0, lws=2)
    a1, ca1 = register(m, "a", lr=1, lws=2)
    assert m.epoch == 1
    b0, _ = register(m, "b", lr=0, lws=2, ready=False)
    assert states_by_key(m)["b"] == "registering"
    register(m, "b", lr=1, lws=2, ready=True)
    assert states_by_key(m)["b"] == "waiting"
    m.ready(b0, 1)  # rank 1 again: still waiting for rank 0
    assert states_by_key(m)["b"] == "waiting"
    m.ready(b0, 0)
    assert states_by_key(m)["b"] == "joining"
    for lr, conn in ((0, ca0), (1, ca1)):
        m.sync(a0, lr, conn, 1, {"epoch": m.epoch, "admit": True})
    assert m.epoch == 2 and states_by_key(m) == {"a": "member", "b": "member"}


def test_a_waiting_node_that_dies_changes_no_epoch():
    clock = FakeClock()
    m = Membership(min_nodes=1, clock=clock)
    a, ca = register(m, "a")
    w, cw = register(m, "w", ready=False)  # stalls: no heartbeat
    k, ck = register(m, "k", ready=False)  # killed: its connection closes
    for _ in range(3):
        clock.now += 1.0
        m.heartbeat(a, 0)
        m.heartbeat(k, 0)
    m.evict(k, "connection of local rank 0 closed")
    clock.now += 10.0
    m.heartbeat(a, 0)
    m.tick()
    assert states_by_key(m) == {"a": "member"} and m.epoch == 1
    assert cw.closed and ck.closed
    assert not [msg for msg in ca.sent if msg.get("type") == "epoch" and msg["epoch"]["epoch"] > 1]
    sync_all(m, [(a, ca)])  # the member's sync point goes through unchanged
    assert ca.sent[-1]["epoch"]["epoch"] == 1 and m.epoch == 1


def test_a_member_and_a_joiner_silent_in_the_same_tick_are_evicted_together():
    """Found at 1024 simulated nodes: a member and a joiner past the heartbeat timeout in one
    tick raised KeyError (the joiner's event listed the members, the member already gone),
    which ended the coordinator's loop. Both go, the member's departure makes one epoch."""
    clock = FakeClock()
    m = Membership(min_nodes=2, clock=clock)
    a, ca = register(m, "a")
    b, cb = register(m, "b")
    c, cc = register(m, "c")  # joins at the next sync point: a joiner until then
    assert m.epoch == 1 and states_by_key(m)["c"] == "joining"
    clock.now += 10.0
    m.heartbeat(a, 0)  # "b" (a member) and "c" (the joiner) went silent together
    m.tick()
    assert states_by_key(m) == {"a": "member"} and m.epoch == 2
    assert cb.closed and cc.closed and not ca.closed
    page = m.page()
    assert any(e.get("node_id") == c.node_id for e in page["events"]), page["events"]


def test_a_listeners_ballot_is_not_waited_for():
    """A member that arrived at its sync point `listening` (a joiner that brings nothing yet)
    does not hold the others' vote: on a slow link its collective ends after theirs. Its
    ballot counts when it came in time; a late one gets the result decided without it."""
    m = Membership(min_nodes=2)
    (a, ca), (b, cb) = register(m, "a"), register(m, "b")
    c, cc = register(m, "c")
    sync_all(m, [(a, ca), (b, cb)])  # admits "c"
    assert m.epoch == 2
    for node, conn, listening in ((a, ca, False), (b, cb, False), (c, cc, True)):
        m.sync(node, 0, conn, 2, {"epoch": m.epoch, "admit": True, "listening": listening})
    assert all(conn.replies(2) for conn in (ca, cb, cc)), "the sync point passed"

    m.vote(a, 0, ca, 3, {"epoch": m.epoch, "seq": 0, "ok": True})
    assert not ca.replies(3), "a contributor's ballot is still awaited"
    m.vote(b, 0, cb, 3, {"epoch": m.epoch, "seq": 0, "ok": True})
    assert ca.replies(3)[0]["result"] is True and cb.replies(3)[0]["result"] is True
    m.vote(c, 0, cc, 3, {"epoch": m.epoch, "seq": 0, "ok": False})  # late, and failed there
    assert cc.replies(3)[0]["result"] is True, "told what the members decided"

    # a listener's ballot that came in time counts: a failed one drops the round for all
    m.vote(c, 0, cc, 4, {"epoch": m.epoch, "seq": 1, "ok": False})
    m.vote(a, 0, ca, 4, {"epoch": m.epoch, "seq": 1, "ok": True})
    m.vote(b, 0, cb, 4, {"epoch": m.epoch, "seq": 1, "ok": True})
    assert [k.replies(4)[0]["result"] for k in (ca, cb, cc)] == [False, False, False]

    # once it arrives contributing, its ballot is waited for again
    for node, conn in ((a, ca), (b, cb), (c, cc)):
        m.sync(node, 0, conn, 5, {"epoch": m.epoch, "admit": True})
    m.vote(a, 0, ca, 6, {"epoch": m.epoch, "seq": 2, "ok": True})
    m.vote(b, 0, cb, 6, {"epoch": m.epoch, "seq": 2, "ok": True})
    assert not ca.replies(6) and not cb.replies(6)
    m.vote(c, 0, cc, 6, {"epoch": m.epoch, "seq": 2, "ok": True})
    assert [k.replies(6)[0]["result"] for k in (ca, cb, cc)] == [True, True, True]


def _listening_round(m: Membership, nodes, listener) -> None:
    """Every node of `nodes` arrives at the sync point; `listener` (one of them) listening."""
    for node, conn in nodes:
        m.sync(node, 0, conn, 2, {"epoch": m.epoch, "admit": True, "listening": node is listener})


def test_a_late_ballot_gets_the_decided_result_across_an_epoch_change():
    """The members decide a vote without the listener's ballot, then one of them leaves (a new
    epoch) before that ballot arrives: it is still told what they decided, not False."""
    m = Membership(min_nodes=3)
    (a, ca), (b, cb), (c, cc) = register(m, "a"), register(m, "b"), register(m, "c")
    _listening_round(m, [(a, ca), (b, cb), (c, cc)], c)
    voted_in = m.epoch
    m.vote(a, 0, ca, 3, {"epoch": voted_in, "seq": 0, "ok": True, "outer": [7, "h7"]})
    m.vote(b, 0, cb, 3, {"epoch": voted_in, "seq": 0, "ok": True, "outer": [7, "h7"]})
    assert ca.replies(3)[0]["result"] is True
    assert ca.replies(3)[0]["outer"] == [7, "h7"], "the contributors' state, told to each"
    m.leave(b, completed=False)
    assert m.epoch == voted_in + 1
    m.vote(c, 0, cc, 3, {"epoch": voted_in, "seq": 0, "ok": True})
    late = cc.replies(3)[0]
    assert late["result"] is True, "told what the members committed"
    assert late["outer"] == [7, "h7"], "and the state it must hold once caught up"
    # a vote of the old epoch still in flight is answered False at the epoch change
    m.vote(a, 0, ca, 4, {"epoch": m.epoch - 1, "seq": 1, "ok": True})
    assert ca.replies(4)[0]["result"] is False


def test_a_listener_stays_one_across_an_epoch_change():
    """A member leaving does not make the others wait for the listener's ballot again."""
    m = Membership(min_nodes=3)
    (a, ca), (b, cb), (c, cc) = register(m, "a"), register(m, "b"), register(m, "c")
    _listening_round(m, [(a, ca), (b, cb), (c, cc)], c)
    m.leave(b, completed=False)
    for node, conn in ((a, ca), (c, cc)):  # "c" is fresh: its retry comes a round early
        m.sync(node, 0, conn, 5, {"epoch": m.epoch, "admit": True})
    m.vote(a, 0, ca, 6, {"epoch": m.epoch, "seq": 0, "ok": True})
    assert not ca.replies(6), "c arrived contributing: its ballot is awaited"

    m2 = Membership(min_nodes=3)
    (a, ca), (b, cb), (c, cc) = register(m2, "a"), register(m2, "b"), register(m2, "c")
    _listening_round(m2, [(a, ca), (b, cb), (c, cc)], c)
    m2.leave(b, completed=False)
    m2.sync(a, 0, ca, 5, {"epoch": m2.epoch, "admit": True})  # the listener has not come yet
    m2.vote(a, 0, ca, 6, {"epoch": m2.epoch, "seq": 0, "ok": True})
    assert ca.replies(6)[0]["result"] is True, "the listener's ballot is not awaited"


def test_a_member_with_other_outer_weights_is_told_and_evicted():
    """Each ballot carries the node's outer step and weight hash: the majority's wins, the
    vote is False so the others retry without the odd one, which is evicted, told why."""
    m = Membership(min_nodes=3)
    nodes = [register(m, k) for k in "abc"]
    sync_all(m, nodes)
    epoch = m.epoch
    for (node, conn), digest in zip(nodes, ["h1", "h1", "h2"], strict=True):
        m.vote(node, 0, conn, 3, {"epoch": epoch, "seq": 0, "ok": True, "outer": [4, digest]})
    assert [conn.replies(3)[0]["result"] for _, conn in nodes] == [False, False, False]
    evicted = [msg for msg in nodes[2][1].sent if msg.get("type") == "evicted"]
    assert evicted and "outer step 4 with hash h2" in evicted[0]["reason"]
    assert "2 of 3 contributing ranks hold outer step 4 with hash h1" in evicted[0]["reason"]
    assert m.epoch == epoch + 1 and states_by_key(m) == {"a": "member", "b": "member"}
    # the two left agree: their retry commits
    for node, conn in nodes[:2]:
        m.sync(node, 0, conn, 4, {"epoch": m.epoch, "admit": True})
        m.vote(node, 0, conn, 5, {"epoch": m.epoch, "seq": 0, "ok": True, "outer": [4, "h1"]})
    assert [conn.replies(5)[0]["result"] for _, conn in nodes[:2]] == [True, True]


def test_a_contributor_with_another_outer_step_count_is_evicted_as_one_with_other_weights():
    """The same weights at another outer step count (a round applied twice or missed, its
    weights equal by chance or not yet changed): the count is part of the state compared."""
    m = Membership(min_nodes=3)
    nodes = [register(m, k) for k in "abc"]
    sync_all(m, nodes)
    epoch = m.epoch
    for (node, conn), count in zip(nodes, [4, 4, 5], strict=True):
        m.vote(node, 0, conn, 3, {"epoch": epoch, "seq": 0, "ok": True, "outer": [count, "h1"]})
    assert [conn.replies(3)[0]["result"] for _, conn in nodes] == [False, False, False]
    evicted = [msg for msg in nodes[2][1].sent if msg.get("type") == "evicted"]
    assert evicted and "outer step 5 with hash h1" in evicted[0]["reason"], evicted
    assert states_by_key(m) == {"a": "member", "b": "member"}


def test_a_ballot_without_outer_state_is_not_compared():
    """A member that did not contribute (a joiner whose state may lag until it caught up)
    votes without its outer state: the others' agreement alone decides."""
    m = Membership(min_nodes=3)
    nodes = [register(m, k) for k in "abc"]
    sync_all(m, nodes)
    for (node, conn), outer in zip(nodes, [[4, "h1"], [4, "h1"], None], strict=True):
        msg = {"epoch": m.epoch, "seq": 0, "ok": True, **({"outer": outer} if outer else {})}
        m.vote(node, 0, conn, 3, msg)
    assert [conn.replies(3)[0]["result"] for _, conn in nodes] == [True, True, True]
    assert states_by_key(m) == {"a": "member", "b": "member", "c": "member"}


def test_a_sync_point_tells_the_node_whose_norm_is_far_outside_the_others():
    """Each contributing rank states its squared norm at the sync point; the coordinator
    tells only the node above `norm_bound` x the median of the others' (`prime_mesh.norms`),
    and a sync point without norms tells nobody."""
    m = Membership(min_nodes=3)
    nodes = [register(m, k) for k in "abc"]
    sync_all(m, nodes)
    for (node, conn), n2 in zip(nodes, (1.0, 1.44, 900.0), strict=True):
        m.sync(node, 0, conn, 2, {"epoch": m.epoch, "admit": True, "norm2": n2,
                                  "norm_bound": 10.0})  # fmt: skip
    replies = [conn.replies(2)[0] for _, conn in nodes]
    assert "outlier" not in replies[0] and "outlier" not in replies[1], replies
    assert "L2 norm 30 is more than 10 x the median" in replies[2]["outlier"], replies[2]
    sync_all(m, nodes)  # (request id 1 again: the next sync point, no norms stated)
    assert all("outlier" not in conn.replies(1)[-1] for _, conn in nodes)


def test_a_run_whose_members_all_listen_forms_anew():
    """Its last contributor left, and every member arrives at the sync point listening: none
    holds the run's state (churn, stop 42: such a run committed empty rounds for 15 minutes
    while its joiners waited for a checkpoint nobody could make). Every member is evicted,
    told to register again, and so is a node waiting to join: the run forms anew from the
    newest checkpoint any of them holds."""
    m = Membership(min_nodes=2)
    (a, ca), (b, cb), (c, cc) = register(m, "a"), register(m, "b"), register(m, "c")
    _listening_round(m, [(a, ca), (b, cb), (c, cc)], c)  # "c" listens; "a" and "b" contribute
    assert len(m.members) == 3
    m.leave(a, completed=False)
    m.leave(b, completed=False)  # the contributors are gone: "c" is the only member
    d, cd = register(m, "d", ready="auto")  # a node joining meanwhile
    assert states_by_key(m) == {"c": "member", "d": "waiting"}  # (fetching state)
    m.sync(c, 0, cc, 7, {"epoch": m.epoch, "admit": True, "listening": True})
    assert not m.members and not m.nodes, m.status()
    evicted = {k: [x for x in conn.sent if x.get("type") == "evicted"] for k, conn in
               (("c", cc), ("d", cd))}  # fmt: skip
    assert "only listening" in evicted["c"][0]["reason"], evicted
    assert "no members left" in evicted["d"][0]["reason"], evicted

    # with a contributor among them the sync point passes as before; the status says who
    # listens (its checkpoints are no donor's: prime-train's `Membership.donors`)
    m2 = Membership(min_nodes=2)
    (a, ca), (b, cb) = register(m2, "a"), register(m2, "b")
    _listening_round(m2, [(a, ca), (b, cb)], b)
    assert len(m2.members) == 2 and ca.replies(2) and cb.replies(2)
    assert {n["metadata"]["k"]: n["listening"] for n in m2.status()["nodes"]} == {
        "a": False, "b": True}  # fmt: skip


def test_nodes_forming_a_run_anew_are_told_the_newest_checkpoint_a_node_of_it_reported():
    """The newest `checkpoint` any node of the run reported with its heartbeats outlives that
    node, and each epoch of the run carries it: founders forming the run anew after its
    members left compare what they hold against it (churn pass 4, seed 5: listeners formed
    the run from a checkpoint 25 outer steps behind the one their last contributor held). A
    run of another config hash, hosted by the same coordinator later, is not told it."""
    m = Membership(min_nodes=1)
    (a, _), (b, _) = register(m, "a", cfg="run1"), register(m, "b", cfg="run1")
    assert "checkpoint" not in m.epoch_info()  # none reported yet
    m.heartbeat(a, 0, [{"step": 40, "checkpoint": 40}])
    m.heartbeat(b, 0, [{"checkpoint": 80}, {"checkpoint": 120}])
    m.heartbeat(a, 0, [{"checkpoint": 80}])  # an older one than b's: b's stays the newest
    m.heartbeat(a, 0, [{"checkpoint": "120"}])  # malformed: counted, not kept
    assert m.epoch_info()["checkpoint"] == (120, b.node_id)
    m.leave(a, completed=False)
    m.leave(b, completed=False)
    assert not m.members
    c, _ = register(m, "c", cfg="run1")  # a founder of the same run, forming it anew
    assert m.members and m.epoch_info()["checkpoint"] == (120, b.node_id)
    m.leave(c, completed=False)
    register(m, "d", cfg="run2")  # another run on the same coordinator
    assert m.members and "checkpoint" not in m.epoch_info()
