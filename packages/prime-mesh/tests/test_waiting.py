"""The waiting state with real node processes: joiners that registered with
wait_until_ready=True are visible but never admitted nor waited for until ready(); one
that dies (SIGKILL) or stalls (SIGSTOP) meanwhile is dropped without disturbing the members.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mesh_node import BOUND, HB_TIMEOUT, mesh_nodes

from prime_mesh import Coordinator
from prime_testkit import mesh_round, node_states, wait_until

TOKEN = "test-token-waiting"
CLI = str(Path(sys.executable).parent / "prime-mesh")


def _round_with_mean(cluster, values: dict[str, float]) -> dict[str, dict]:
    """mesh_round's reinit report of each node, with its mean."""
    reinit, ok = mesh_round(cluster, values, timeout=BOUND + 30)
    return {n: {**reinit[n], "mean": ok[n]["mean"]} for n in values}


@pytest.mark.timeout(240)
def test_waiting_joiners_are_visible_never_waited_for_and_admitted_when_ready(children):
    coord = Coordinator("127.0.0.1", 0, token=TOKEN, min_nodes=2).start()
    try:
        cluster = mesh_nodes(children, coord.address, TOKEN)
        for n in "ab":
            cluster.start(n, metadata={"serve_url": f"http://{n}"})
        joined = {n: cluster.expect(n, "joined", timeout=120) for n in "ab"}
        epoch = joined["a"]["epoch"]
        value = {"a": 1.0, "b": 3.0}
        assert {r["mean"] for r in _round_with_mean(cluster, value).values()} == {2.0}

        # Three joiners register and wait: the constructor returns at once for each.
        for n in ("k", "s", "w"):
            cluster.start(n, wait_until_ready=True, metadata={"serve_url": f"http://{n}"})
        reg = {n: cluster.expect(n, "registered", timeout=120) for n in ("k", "s", "w")}
        assert {r["state"] for r in reg.values()} == {"waiting"}
        cluster.send("a", "members")
        members = cluster.expect("a", "members")["members"]
        assert [m["state"] for m in members] == ["member", "member", *["waiting"] * 3]
        # the members can read the waiting nodes' metadata, and the joiners the members'
        assert {m["metadata"]["serve_url"] for m in members} == {
            f"http://{n}" for n in ("a", "b", "k", "s", "w")
        }
        cluster.send("w", "members")
        seen_by_w = cluster.expect("w", "members")["members"]
        donors = sorted(m["metadata"]["serve_url"] for m in seen_by_w if m["state"] == "member")
        assert donors == ["http://a", "http://b"]

        env = {**os.environ, "PRIME_TOKEN": TOKEN}
        out = subprocess.run(
            [CLI, "status", "--coordinator", coord.address],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "2 members, 0 joining, 3 waiting, 0 registering" in out.stdout, out.stdout
        assert len(re.findall(r"node-\d +waiting +rank - .*http://[ksw]", out.stdout)) == 3

        # Sync points do not admit them and collectives go on over the two members.
        for _ in range(2):
            r = _round_with_mean(cluster, value)
            assert all(
                not x["changed"] and x["epoch"] == epoch and x["mean"] == 2.0 for x in r.values()
            )

        # One waiting node is killed, one stalls past the heartbeat timeout: both are dropped
        # and the members notice nothing (same epoch, no failed collective).
        cluster.signal("k", signal.SIGKILL)
        cluster.signal("s", signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_until(lambda: len(node_states(coord)) == 4, BOUND, what="the killed joiner dropped")
        while time.monotonic() - stopped_at < HB_TIMEOUT + 1:
            r = _round_with_mean(cluster, value)
            assert all(
                not x["changed"] and x["epoch"] == epoch and x["mean"] == 2.0 for x in r.values()
            )
        wait_until(lambda: len(node_states(coord)) == 3, BOUND, what="the stalled joiner dropped")
        assert sorted(node_states(coord).values()) == ["member", "member", "waiting"]
        assert coord.status()["epoch"] == epoch
        cluster.signal("s", signal.SIGCONT)
        deadline = time.monotonic() + BOUND  # (until its client has read the eviction)
        while True:
            cluster.send("s", "check")
            kind, err = cluster.get("s", BOUND)
            if kind != "check" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert kind == "error", (kind, err)
        assert err["type"] == "MeshEvicted" and "no heartbeat" in err["msg"], err

        # "w" says ready: admitted at the members' next sync point, last; its first sync point
        # is that one, so it meets the members in the collective that follows.
        cluster.send("w", "ready")
        assert cluster.expect("w", "ready")["state"] == "joining"
        assert sorted(node_states(coord).values()) == ["joining", "member", "member"]
        value["w"] = 8.0
        r = _round_with_mean(cluster, value)
        assert {(x["epoch"], x["world"], x["mean"]) for x in r.values()} == {(epoch + 1, 3, 4.0)}
        assert r["w"]["changed"] and r["w"]["rank"] == 2
        assert all(x["changed"] for x in r.values())
        r = _round_with_mean(cluster, value)  # and then it is a member like the others
        assert {(x["changed"], x["epoch"], x["mean"]) for x in r.values()} == {
            (False, epoch + 1, 4.0)
        }
        cluster.send(["a", "b", "w", "s"], "exit")
    finally:
        coord.close()
