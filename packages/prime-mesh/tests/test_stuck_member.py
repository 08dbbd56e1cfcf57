"""A member that heartbeats but never reaches its sync point (its main thread stuck) does not
hold the others: real node processes, gloo groups on 127.0.0.1, the real coordinator.

Heartbeat interval 0.5 s and timeout 3 s, sync timeout 2 s: the stuck node is left out by the
sync timeout, not by its heartbeats (they go on), then rejoins as a new member.
"""

import pytest
from mesh_node import BOUND, mesh_nodes

from prime_mesh import Coordinator
from prime_testkit import mesh_round, node_states

TOKEN = "test-token-stuck-member"
SYNC_TIMEOUT = 2.0


@pytest.mark.timeout(240)
def test_a_stuck_heartbeating_member_is_left_out_and_rejoins(children):
    coord = Coordinator("127.0.0.1", 0, token=TOKEN, min_nodes=3).start()
    try:
        cluster = mesh_nodes(children, coord.address, TOKEN)
        names = ["a", "b", "c"]
        for n in names:
            cluster.start(n, sync_timeout=SYNC_TIMEOUT)
        joined = {n: cluster.expect(n, "joined", timeout=120) for n in names}
        value = {"a": 1.0, "b": 2.0, "c": 6.0}
        reinit, ok = mesh_round(cluster, value, timeout=BOUND + 30)
        assert {r["world"] for r in reinit.values()} == {3} and {
            o["mean"] for o in ok.values()
        } == {3.0}

        # "c" stays away from the sync point (its process idles, heartbeating): the two
        # others are answered with a group of two once the first has waited SYNC_TIMEOUT
        cluster.send(["a", "b"], "reinit")
        left = {n: cluster.expect(n, "reinit", timeout=BOUND + 30) for n in "ab"}
        assert all(r["changed"] and r["world"] == 2 for r in left.values()), left
        assert left["a"]["epoch"] == joined["a"]["epoch"] + 1
        assert min(r["elapsed"] for r in left.values()) >= SYNC_TIMEOUT
        events = coord.page_status()["events"]
        assert events[-1]["kind"] == "evicted" and "sync point" in events[-1]["reason"], events
        for n in "ab":
            cluster.send(n, "allreduce", value=value[n])
        assert {cluster.expect(n, "ok", timeout=BOUND + 30)["mean"] for n in "ab"} == {1.5}

        # when "c" comes back to its sync point, it is told it was left out, then rejoins
        cluster.send("c", "reinit")
        err = cluster.expect("c", "error", timeout=BOUND)
        assert err["type"] == "MeshEvicted" and "did not reach the sync point" in err["msg"], err
        cluster.send("c", "rejoin", kwargs={"sync_timeout": SYNC_TIMEOUT, "wait": False})
        assert cluster.expect("c", "registered", timeout=BOUND)["state"] == "joining"
        assert sorted(node_states(coord).values()) == ["joining", "member", "member"]
        cluster.send(["a", "b"], "vote", ok=True)
        assert {cluster.expect(n, "vote", timeout=BOUND + 30)["result"] for n in "ab"} == {True}
        reinit, ok = mesh_round(cluster, value, timeout=BOUND + 30)
        assert {(r["world"], r["epoch"]) for r in reinit.values()} == {(3, left["a"]["epoch"] + 1)}
        assert {o["mean"] for o in ok.values()} == {3.0}
        cluster.send(names, "exit")
    finally:
        coord.close()
