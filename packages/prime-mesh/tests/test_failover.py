"""Four real node processes on 127.0.0.1 with gloo groups: crash, stall, join, leave, votes.

Heartbeat interval 0.5 s and timeout 3 s; every bound is a loose 2 x timeout + 5 s.
"""

import signal
import time

import pytest
from mesh_node import BOUND, mesh_nodes

from prime_testkit import node_states, wait_until

TOKEN = "test-token-failover"
MIN_NODES = 4  # of the `coordinator` fixture (conftest.py)


def _form(children, coordinator, names):
    cluster = mesh_nodes(children, coordinator.address, TOKEN)
    for n in names:
        cluster.start(n)
    joined = {n: cluster.expect(n, "joined", timeout=120) for n in names}
    assert sorted(j["rank"] for j in joined.values()) == list(range(len(names)))
    assert {j["world"] for j in joined.values()} == {len(names)}
    return cluster, joined


def _allreduce(cluster, values, timeout=BOUND + 30):
    for n, v in values.items():
        cluster.send(n, "allreduce", value=v)
    return {n: cluster.get(n, timeout) for n in values}


@pytest.mark.timeout(240)
def test_sigkill_vote_join_and_leave(children, coordinator):
    names = ["a", "b", "c", "d"]
    cluster, joined = _form(children, coordinator, names)
    value = {n: float(i + 1) for i, n in enumerate(names)}

    got = _allreduce(cluster, value)
    assert all(kind == "ok" and kw["mean"] == 2.5 for kind, kw in got.values()), got
    cluster.send("a", "local")  # no torchrun env: a world-size-1 CPU mesh
    assert cluster.expect("a", "local")["size"] == 1

    # should_commit: one member reports failure, so nobody commits; all ok commits.
    for n in names:
        cluster.send(n, "vote", ok=(n != "b"))
    assert {cluster.expect(n, "vote")["result"] for n in names} == {False}
    for n in names:
        cluster.send(n, "vote", ok=True)
    assert {cluster.expect(n, "vote")["result"] for n in names} == {True}

    # SIGKILL "d" as it enters an all-reduce the others are already inside.
    survivors = ["a", "b", "c"]
    for n in survivors:
        cluster.send(n, "allreduce", value=value[n])
    time.sleep(0.3)
    cluster.send("d", "allreduce", value=value["d"], then="kill")
    killed_at = time.time()
    for n in survivors:
        kind, kw = cluster.get(n, BOUND + 30)
        assert kind in ("failed", "aborted"), (n, kind, kw)
        cluster.send(n, "reinit")
    reinit = {n: cluster.expect(n, "reinit", timeout=BOUND + 30) for n in survivors}
    assert all(r["changed"] and r["world"] == 3 for r in reinit.values()), reinit
    # survivors keep their relative order
    by_old_rank = sorted(survivors, key=lambda n: joined[n]["rank"])
    assert [reinit[n]["rank"] for n in by_old_rank] == [0, 1, 2]
    assert max(r["t"] for r in reinit.values()) - killed_at < BOUND
    got = _allreduce(cluster, {n: value[n] for n in survivors})
    assert all(
        kind == "ok" and kw["mean"] == 2.0 and kw["world"] == 3 for kind, kw in got.values()
    ), got

    # A joiner blocks until the members' next sync point, then goes last.
    cluster.start("e")
    wait_until(
        lambda: list(node_states(coordinator).values()).count("joining") == 1,
        60,
        what="joiner registered",
    )
    time.sleep(0.5)
    with pytest.raises(TimeoutError):
        cluster.get("e", timeout=0.5)  # not admitted between sync points
    cluster.send("a", "members")
    states = {m["node_id"]: m["state"] for m in cluster.expect("a", "members")["members"]}
    assert sorted(states.values()) == ["joining", "member", "member", "member"]
    cluster.send(survivors, "reinit")
    e = cluster.expect("e", "joined", timeout=BOUND + 30)
    assert (e["rank"], e["world"]) == (3, 4)
    for n in survivors:
        r = cluster.expect(n, "reinit", timeout=BOUND + 30)
        assert r["changed"] and r["world"] == 4 and r["epoch"] == e["epoch"]
    # The sync point that admitted it is its own: its first one returns that group at once
    # (the members are not at a sync point now), and it meets them in the next collective.
    cluster.send("e", "reinit")
    r = cluster.expect("e", "reinit", timeout=BOUND)
    assert r["changed"] and (r["epoch"], r["rank"], r["world"]) == (e["epoch"], 3, 4), r
    value["e"] = 10.0
    got = _allreduce(cluster, {n: value[n] for n in [*survivors, "e"]})
    assert all(kind == "ok" and kw["mean"] == 4.0 for kind, kw in got.values()), got
    # ...and its next one is the members' next sync point, as for everyone
    cluster.send([*survivors, "e"], "reinit")
    assert [cluster.expect(n, "reinit")["changed"] for n in [*survivors, "e"]] == [False] * 4

    # Graceful leave: the others see the new epoch at once (no heartbeat timeout to wait).
    cluster.send("b", "close")
    cluster.expect("b", "closed")
    left_at = time.time()
    rest = ["a", "c", "e"]
    for n in rest:
        cluster.send(n, "reinit")
    for n in rest:
        r = cluster.expect(n, "reinit", timeout=BOUND)
        assert r["changed"] and r["world"] == 3
        assert r["t"] - left_at < BOUND
    got = _allreduce(cluster, {n: value[n] for n in rest})
    assert all(kind == "ok" and kw["mean"] == 14.0 / 3 for kind, kw in got.values()), got
    # Sync point with nothing to change: unchanged, same group.
    cluster.send(rest, "reinit")
    assert [cluster.expect(n, "reinit")["changed"] for n in rest] == [False] * 3
    cluster.send([*rest, "b"], "exit")


@pytest.mark.timeout(240)
def test_sigstop_straggler_is_released_evicted_and_rejoins(children, coordinator):
    names = ["a", "b", "c", "d"]
    cluster, _ = _form(children, coordinator, names)
    value = {n: float(i + 1) for i, n in enumerate(names)}
    survivors = ["a", "b", "c"]

    # A peer that is alive (heartbeating) but never joins the collective: only the deadline
    # releases the others, and the next sync point gives everyone a fresh group.
    for n in survivors:
        cluster.send(n, "allreduce", value=value[n], timeout=2.0)
    for n in survivors:
        assert cluster.get(n, BOUND + 30)[0] == "deadline"
    cluster.send(names, "reinit")
    fresh = {n: cluster.expect(n, "reinit", timeout=BOUND + 30) for n in names}
    assert all(r["changed"] and r["world"] == 4 for r in fresh.values()), fresh
    assert len({r["epoch"] for r in fresh.values()}) == 1
    got = _allreduce(cluster, value)
    assert all(kind == "ok" and kw["mean"] == 2.5 for kind, kw in got.values()), got

    # SIGSTOP "d" in the middle of an all-reduce: a straggler only the heartbeats reveal.
    # (64 MB: under load, a small all-reduce could finish in the moment between d starting it
    # and stopping itself)
    for n in survivors:
        cluster.send(n, "allreduce", value=value[n], n=1 << 24)
    time.sleep(0.3)
    cluster.send("d", "allreduce", value=value["d"], n=1 << 24, then="stop")
    time.sleep(0.3)
    stopped_at = time.time()
    for n in survivors:
        kind, kw = cluster.get(n, BOUND + 30)
        assert kind == "aborted", (n, kind, kw)  # released by should_abort, not the deadline
        assert kw["t"] - stopped_at < BOUND
        cluster.send(n, "reinit")
    for n in survivors:
        r = cluster.expect(n, "reinit", timeout=BOUND)
        assert r["changed"] and r["world"] == 3
    got = _allreduce(cluster, {n: value[n] for n in survivors})
    assert all(kind == "ok" and kw["mean"] == 2.0 for kind, kw in got.values()), got

    # The straggler wakes inside its collective: a clear "evicted, rejoin" error, then rejoins.
    cluster.signal("d", signal.SIGCONT)
    err = cluster.expect("d", "error", timeout=BOUND)
    assert err["type"] == "MeshEvicted" and "evicted" in err["msg"] and "rejoin" in err["msg"], err
    # Its installed group stays readable by `installed_group` (a round whose vote passed
    # before the node learned of its eviction is committed everywhere, and the node still
    # records it), while the other views raise.
    cluster.send("d", "installed")
    seen = cluster.expect("d", "installed", timeout=BOUND)
    assert (seen["world"], seen["epoch"]) == (4, fresh["d"]["epoch"]), (seen, fresh["d"])
    cluster.send("d", "rejoin")
    wait_until(
        lambda: list(node_states(coordinator).values()).count("joining") == 1,
        60,
        what="straggler re-registered",
    )
    cluster.send(survivors, "reinit")
    d = cluster.expect("d", "joined", timeout=BOUND + 30)
    assert (d["rank"], d["world"]) == (3, 4) and d["node_id"] != "node-4"
    for n in survivors:
        assert cluster.expect(n, "reinit", timeout=BOUND + 30)["world"] == 4
    got = _allreduce(cluster, value)
    assert all(kind == "ok" and kw["mean"] == 2.5 for kind, kw in got.values()), got
    cluster.send(names, "exit")
