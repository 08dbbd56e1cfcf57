"""A coordinator restarted on the same address re-forms the run from the nodes that reconnect.

The state machine alone (fake connections and clock), a forged or malformed reconnect against
a real coordinator, and real node processes that lose their coordinator and get a new one.
"""

import pytest
from mesh_node import BOUND, mesh_nodes

from prime_mesh import Coordinator, MeshAuthError, MeshRefused
from prime_mesh.client import CoordinatorClient
from prime_mesh.membership import Membership
from prime_mesh.wire import resolve_token
from prime_testkit import FakeClock, FakeConn, free_port, wait_until

TOKEN = "test-token-reform"


def _reconnect(m: Membership, key: str, node_id: str, epoch: int, step: int, digest: str):
    resume = {
        "node_id": node_id,
        "epoch": epoch,
        "members": ["node-2", "node-5", "node-3"],  # the old rank order
        "outer_step": step,
        "outer_hash": digest,
    }
    conn = FakeConn()
    msg = {"node_key": key, "local_rank": 0, "local_world_size": 1, "resume": resume}
    return m.register(conn, {**msg, "metadata": {}}), conn


def test_reform_keeps_rank_order_numbers_above_and_sends_the_stale_node_away():
    clock = FakeClock()
    m = Membership(min_nodes=5, clock=clock, reform_wait=30.0)  # min_nodes is not applied
    _reconnect(m, "k3", "node-3", 7, 4, "old")  # a round behind: sent to rejoin
    _, conn5 = _reconnect(m, "k5", "node-5", 7, 5, "h")
    assert m.epoch == 0 and not m.members, "waits for every member of the newest epoch"
    _, conn2 = _reconnect(m, "k2", "node-2", 6, 5, "h")  # one epoch behind, same weights
    assert m.epoch == 8, "numbered above the highest epoch reported"
    assert [m.nodes[k].node_id for k in m.members] == ["node-2", "node-5"]
    pushed = [msg for msg in conn5.sent if msg["type"] == "epoch"]
    assert pushed[-1]["epoch"]["members"] == ["node-2", "node-5"]
    assert "k3" not in m.nodes and "k3" in m.gone
    # an evicted node reconnecting to the coordinator that evicted it (its link was cut) is
    # told to rejoin through live recovery (the client raises MeshEvicted), not refused
    with pytest.raises(Exception, match="rejoin through live recovery") as e:
        _reconnect(m, "k3", "node-3", 8, 5, "h")
    assert type(e.value).kind == "rejoin"
    # a plain joiner registering later gets a fresh id, not a missing member's
    joiner = m.register(FakeConn(), {"node_key": "j", "local_rank": 0, "local_world_size": 1})
    assert joiner.node_id == "node-6" and m.state_of(joiner) == "joining"


def test_reform_without_missing_members_after_the_wait_and_late_ones_rejoin():
    clock = FakeClock()
    m = Membership(min_nodes=3, clock=clock, reform_wait=30.0)
    node, _ = _reconnect(m, "k5", "node-5", 3, 9, "h")
    for clock.now in (29.0, 31.0):
        assert not m.members
        m.heartbeat(node, 0)
        m.tick()
    assert m.epoch == 4 and [m.nodes[k].node_id for k in m.members] == ["node-5"]
    with pytest.raises(Exception, match="rejoin through live recovery") as e:
        _reconnect(m, "k2", "node-2", 3, 9, "h")
    assert type(e.value).kind == "rejoin"


def test_forged_or_malformed_reconnect_is_refused():
    coord = Coordinator("127.0.0.1", 0, token=TOKEN).start()
    try:
        resume = {
            "node_id": "node-1",
            "epoch": 4,
            "members": ["node-1"],
            "outer_step": 9,
            "outer_hash": "h",
        }
        register = {"type": "register", "node_key": "x", "local_rank": 0, "local_world_size": 1}
        with pytest.raises(MeshAuthError):  # a forger without the token
            client = CoordinatorClient(coord.address, resolve_token("not-the-token"))
            try:
                client.request({**register, "resume": resume}, timeout=10)
            finally:
                client.close()
        client = CoordinatorClient(coord.address, resolve_token(TOKEN))
        try:
            with pytest.raises(MeshRefused, match="malformed resume record"):
                client.request({**register, "resume": {**resume, "epoch": "4"}}, timeout=10)
        finally:
            client.close()
        assert coord.status()["nodes"] == [] and coord.status()["epoch"] == 0
    finally:
        coord.close()


def _start(cluster, names: str | list[str]) -> dict[str, dict]:
    """Start node processes `names` (a 60 s coordinator grace); their `joined` reports."""
    for n in names:
        cluster.start(n, coordinator_grace_s=60.0)
    return {n: cluster.expect(n, "joined", timeout=120) for n in names}


def _note(cluster, notes: list[tuple[str, int, str]]) -> None:
    """Tell each node its last committed outer step and weight hash: (name, step, hash)."""
    for n, step, digest in notes:
        cluster.send(n, "note", outer_step=step, outer_hash=digest)
        cluster.expect(n, "noted")


def _group_works(cluster) -> None:
    """a and b all-reduce over the group they now hold (rendezvous through the new store)."""
    cluster.send("a", "allreduce", value=1.0)
    cluster.send("b", "allreduce", value=3.0)
    assert [cluster.expect(n, "ok")["mean"] for n in "ab"] == [2.0, 2.0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_restarted_coordinator_reforms_the_run(children):
    port = free_port()
    coord = Coordinator("127.0.0.1", port, token=TOKEN, min_nodes=3).start()
    cluster = mesh_nodes(children, coord.address, TOKEN)
    names = ["a", "b", "c", "d"]
    try:
        joined = _start(cluster, names[:3])
        cluster.start("d", coordinator_grace_s=60.0)  # joins, then leaves: epochs 2 and 3
        wait_until(lambda: len(coord.status()["nodes"]) == 4, 60, what="d registered")
        cluster.send(names, "reinit")
        assert {cluster.expect(n, "reinit")["epoch"] for n in names[:3]} == {2}
        cluster.expect("d", "joined", timeout=BOUND)
        cluster.expect("d", "reinit")
        cluster.send("d", "close")
        cluster.expect("d", "closed")
        cluster.send(names[:3], "reinit")
        before = {n: cluster.expect(n, "reinit") for n in names[:3]}
        assert {b["epoch"] for b in before.values()} == {3}
        _note(cluster, [("a", 5, "h5"), ("b", 5, "h5"), ("c", 4, "h4")])
        coord.close()  # its sockets close, as when its process is killed
        # min_nodes 5 would never form a new run: it is not applied to a re-formation
        coord = Coordinator("127.0.0.1", port, token=TOKEN, min_nodes=5).start()
        order = sorted("ab", key=lambda n: before[n]["rank"])  # the old rank order
        cluster.send(order[1], "reinit")  # the higher rank reconnects first: the order holds
        wait_until(lambda: len(coord.status()["nodes"]) == 1, 60, what="first one reconnected")
        cluster.send(["c", order[0]], "reinit")
        after = {n: cluster.expect(n, "reinit", timeout=120) for n in "ab"}  # loaded CI
        assert {a["epoch"] for a in after.values()} == {4}
        assert all(a["changed"] for a in after.values())
        assert [after[n]["node_id"] for n in "ab"] == [joined[n]["node_id"] for n in "ab"]
        assert [after[n]["rank"] for n in order] == [0, 1] and after["a"]["world"] == 2
        err = cluster.expect("c", "error", timeout=BOUND)
        assert err["type"] == "MeshEvicted" and "rejoin through live recovery" in err["msg"]
        status = coord.status()
        assert status["epoch"] == 4
        assert [(n["node_id"], n["rank"]) for n in status["nodes"]] == [
            (joined[order[0]]["node_id"], 0),
            (joined[order[1]]["node_id"], 1),
        ]
        _group_works(cluster)
        cluster.send(["a", "b", "c"], "exit")
    finally:
        coord.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_epoch_the_lost_coordinator_pushed_is_void_and_who_it_left_out_is_not_waited_for(
    children,
):
    """The old coordinator evicts c and pushes epoch 2 to a and b, which never install it;
    the restarted one numbers its own epoch 2 (other prefix): the nodes must wait for that.
    c left before the loss, so the re-formed run does not wait for it (reform_wait is far
    longer than the nodes' bounded wait: a wait for c would fail the test)."""
    port = free_port()
    coord = Coordinator("127.0.0.1", port, token=TOKEN, min_nodes=3).start()
    cluster = mesh_nodes(children, coord.address, TOKEN)
    try:
        _start(cluster, "abc")
        _note(cluster, [("a", 5, "h5"), ("b", 5, "h5")])
        cluster.send("c", "exit")  # its connection closes: epoch 2 is pushed to a and b

        def holds_epoch_2(n: str) -> bool:  # should_abort: a newer epoch waits to be installed
            cluster.send(n, "check")
            return cluster.expect(n, "check")["abort"]

        for n in "ab":
            wait_until(lambda n=n: holds_epoch_2(n), 60, what=f"{n} got epoch 2")
        coord.close()
        coord = Coordinator("127.0.0.1", port, token=TOKEN, reform_wait=600.0).start()
        cluster.send(["a", "b"], "reinit")
        after = {n: cluster.expect(n, "reinit", timeout=120) for n in "ab"}
        # installed only once the new coordinator re-formed, with a and b back: not c
        assert coord.status()["epoch"] == 2 and {a["epoch"] for a in after.values()} == {2}
        _group_works(cluster)
        cluster.send(["a", "b"], "exit")
    finally:
        coord.close()


@pytest.mark.timeout(180)
def test_a_vote_after_the_loss_reconnects_and_is_not_committed(children):
    """The coordinator dies between the sync point and the vote (an overlapped round): the
    vote reconnects like a sync point would, and answers False on every node."""
    port = free_port()
    coord = Coordinator("127.0.0.1", port, token=TOKEN, min_nodes=2).start()
    cluster = mesh_nodes(children, coord.address, TOKEN)
    try:
        _start(cluster, "ab")
        _note(cluster, [("a", 3, "h3"), ("b", 3, "h3")])
        coord.close()

        def noticed(n: str) -> bool:  # its heartbeats found the coordinator gone
            cluster.send(n, "check")
            kind, kw = cluster.get(n)
            return kind == "error" and kw["type"] == "CoordinatorLost"

        for n in "ab":
            wait_until(lambda n=n: noticed(n), 60, what=f"{n} noticed the loss")
        coord = Coordinator("127.0.0.1", port, token=TOKEN).start()
        cluster.send(["a", "b"], "vote", ok=True)
        assert [cluster.expect(n, "vote", timeout=120)["result"] for n in "ab"] == [False, False]
        assert coord.status()["epoch"] == 2
        cluster.send(["a", "b"], "reinit")  # the next sync point builds the group afresh
        assert {cluster.expect(n, "reinit")["epoch"] for n in "ab"} == {2}
        _group_works(cluster)
        cluster.send(["a", "b"], "exit")
    finally:
        coord.close()


@pytest.mark.timeout(120)
def test_no_coordinator_within_the_grace_is_coordinator_gone(children):
    coord = Coordinator("127.0.0.1", free_port(), token=TOKEN, min_nodes=2).start()
    cluster = mesh_nodes(children, coord.address, TOKEN)
    try:
        for n in "ab":
            cluster.start(n, coordinator_grace_s=2.0)
        for n in "ab":
            cluster.expect(n, "joined", timeout=120)
    finally:
        coord.close()
    cluster.send(["a", "b"], "reinit")
    for n in "ab":
        err = cluster.expect(n, "error", timeout=BOUND + 30)
        assert err["type"] == "CoordinatorGone" and "coordinator_grace_s" in err["msg"], err
    cluster.send(["a", "b"], "exit")


def test_a_node_told_to_found_the_run_before_its_members_came_back_is_sent_to_join_them():
    """Churn seed 16 (12 events): a node registered "auto" at the restarted coordinator before
    any member reconnected, so it was told to found the run (min_nodes 2: it waited); the
    members then re-formed the run and it was admitted at their next sync point while it
    resumed as a founder: their collectives differed and gloo aborted it. It is evicted when
    the run re-forms, told to register again, and registering again makes it a joiner."""
    clock = FakeClock()
    m = Membership(min_nodes=2, clock=clock, reform_wait=30.0)
    msg = {"local_rank": 0, "local_world_size": 1, "ready": "auto", "metadata": {}}
    early = FakeConn()
    founder = m.register(early, {**msg, "node_key": "f"})
    assert not founder.joining and founder.founding and not m.members
    _reconnect(m, "k5", "node-5", 7, 5, "h")
    _reconnect(m, "k2", "node-2", 7, 5, "h")
    _reconnect(m, "k3", "node-3", 7, 5, "h")
    assert [m.nodes[k].node_id for k in m.members] == ["node-2", "node-5", "node-3"]
    told = [x for x in early.sent if x.get("type") == "evicted"]
    assert "f" not in m.nodes and len(told) == 1, early.sent
    assert "re-formed from its members after a coordinator restart" in told[0]["reason"]
    again = m.register(FakeConn(), {**msg, "node_key": "f2"})
    assert again.joining and not again.founding and m.state_of(again) == "waiting"
    assert m.epoch == 8, "its eviction made no epoch: it was not a member"


def test_a_member_back_and_evicted_again_is_not_waited_for():
    """Churn seed 17: of the four members, two reconnected to the restarted coordinator and
    were evicted again (one killed, one stalled past the heartbeat timeout); the re-formation
    waited its whole 30 s for them, and the run had no commit for 34.6 s."""
    clock = FakeClock()
    m = Membership(min_nodes=3, clock=clock, reform_wait=30.0)
    _reconnect(m, "k2", "node-2", 7, 5, "h")
    k5, _ = _reconnect(m, "k5", "node-5", 7, 5, "h")
    clock.now = 2.0
    m.evict(k5, "connection of local rank 0 closed")  # (killed after it came back)
    assert not m.members, "node-3 is not back yet"
    _reconnect(m, "k3", "node-3", 7, 5, "h")
    assert m.epoch == 8 and [m.nodes[k].node_id for k in m.members] == ["node-2", "node-3"]
