"""Members departing close together cost one epoch: the coordinator's state machine with a
fake clock and its departure window (`prime_mesh.departures`)."""

from prime_mesh.departures import DEPART_BATCH_S
from prime_mesh.membership import Membership
from prime_testkit import FakeClock, form


def test_ten_percent_leaving_and_dying_together_make_one_epoch():
    clock = FakeClock()
    m = Membership(min_nodes=20, clock=clock, depart_batch_s=DEPART_BATCH_S)
    nodes = form(m, [f"k{i}" for i in range(20)])
    # k0 leaves, k1's connection closes, all within the window: the epoch holds meanwhile
    m.leave(nodes["k0"][0], completed=False)
    clock.now += DEPART_BATCH_S / 2
    m.evict(nodes["k1"][0], "connection of local rank 0 closed")
    m.tick()
    assert m.epoch == 1 and len(m.members) == 20
    clock.now += DEPART_BATCH_S / 2
    m.tick()
    assert m.epoch == 2 and len(m.members) == 18
    assert not {"k0", "k1"} & set(m.nodes)
    for k in ("k0", "k1"):
        assert nodes[k][1].closed and nodes[k][1].sent[-1]["type"] == "evicted"


def test_no_sync_point_passes_and_no_vote_is_decided_while_a_departure_waits():
    clock = FakeClock()
    m = Membership(min_nodes=3, clock=clock, depart_batch_s=DEPART_BATCH_S)
    nodes = form(m, [f"k{i}" for i in range(3)])
    for k in ("k0", "k1"):  # two members vote, then the third, which dies right after
        node, conn = nodes[k]
        m.vote(node, 0, conn, 5, {"epoch": 1, "seq": 0, "ok": True})
    m.evict(nodes["k2"][0], "connection of local rank 0 closed")
    assert not nodes["k0"][1].replies()
    clock.now += DEPART_BATCH_S
    m.tick()  # the departure's epoch answers the vote: not committed
    assert m.epoch == 2
    for k in ("k0", "k1"):
        (answer,) = nodes[k][1].replies()
        assert answer["result"] is False and answer["reason"] == "the epoch changed"
    # the survivors' sync point in the new epoch passes as before
    for k in ("k0", "k1"):
        node, conn = nodes[k]
        m.sync(node, 0, conn, 9, {"epoch": 2, "admit": True})
    assert [r["epoch"]["epoch"] for r in nodes["k0"][1].replies()[1:]] == [2]


def test_a_sync_point_waits_for_the_departures_epoch():
    clock = FakeClock()
    m = Membership(min_nodes=3, clock=clock, depart_batch_s=DEPART_BATCH_S)
    nodes = form(m, [f"k{i}" for i in range(3)])
    m.sync(nodes["k2"][0], 0, nodes["k2"][1], 3, {"epoch": 1, "admit": True})
    m.evict(nodes["k2"][0], "connection of local rank 0 closed")  # arrived, then died
    for k in ("k0", "k1"):
        node, conn = nodes[k]
        m.sync(node, 0, conn, 3, {"epoch": 1, "admit": True})
    assert not nodes["k0"][1].replies()  # not released into the epoch that holds k2
    clock.now += DEPART_BATCH_S
    m.tick()
    for k in ("k0", "k1"):
        (answer,) = nodes[k][1].replies()
        assert answer["epoch"]["epoch"] == 2 and len(answer["epoch"]["members"]) == 2


def test_a_departing_member_that_also_stops_heartbeating_is_evicted_once():
    clock = FakeClock()
    m = Membership(min_nodes=3, clock=clock, depart_batch_s=DEPART_BATCH_S)
    nodes = form(m, [f"k{i}" for i in range(3)])
    m.evict(nodes["k2"][0], "connection of local rank 0 closed")
    clock.now += 6.0  # past the heartbeat timeout (5 s) of every node: all three are silent
    for k in ("k0", "k1"):
        m.heartbeat(nodes[k][0], 0)
    m.tick()  # k2 is both departing and silent: one eviction, one epoch
    assert m.epoch == 2 and m.members == ["k0", "k1"]
    assert [msg["type"] for msg in nodes["k2"][1].sent].count("evicted") == 1
