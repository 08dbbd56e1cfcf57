"""Two nodes with two local ranks each (torchrun-style env + intra-node gloo default group)."""

import signal
import time

import pytest
from mesh_node import BOUND, mesh_nodes

from prime_mesh import Coordinator
from prime_testkit import free_port

TOKEN = "test-token-local"


@pytest.mark.timeout(240)
def test_two_local_ranks_form_two_consistent_groups(children):
    coord = Coordinator("127.0.0.1", 0, token=TOKEN, min_nodes=2).start()
    try:
        cluster = mesh_nodes(children, coord.address, TOKEN)
        ranks = {}
        for node in "xy":
            port = free_port()
            for lr in range(2):
                name = f"{node}{lr}"
                env = {"LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": "2"}
                cluster.start(name, env=env, local_store=("127.0.0.1", port, lr, 2))
                ranks[name] = lr
        names = list(ranks)
        joined = {n: cluster.expect(n, "joined", timeout=150) for n in names}
        # one registration per node: both local ranks share the node id and the global rank
        for node in "xy":
            a, b = joined[f"{node}0"], joined[f"{node}1"]
            assert a["node_id"] == b["node_id"] and a["rank"] == b["rank"]
        assert {j["world"] for j in joined.values()} == {2}
        assert len({j["epoch"] for j in joined.values()}) == 1
        st = coord.status()
        assert [n["local_world_size"] for n in st["nodes"]] == [2, 2]

        # local rank r of each node is in inter-node group r: the groups reduce separately.
        value = {"x0": 1.0, "y0": 2.0, "x1": 10.0, "y1": 20.0}
        for n, v in value.items():
            cluster.send(n, "allreduce", value=v)
        got = {n: cluster.expect(n, "ok", timeout=60) for n in names}
        assert got["x0"]["mean"] == got["y0"]["mean"] == 1.5
        assert got["x1"]["mean"] == got["y1"]["mean"] == 15.0

        cluster.send(names, "local")
        for n in names:
            loc = cluster.expect(n, "local", timeout=60)
            assert loc["size"] == 2 and loc["lws"] == 2 and loc["local_rank"] == ranks[n]

        # Losing one local rank evicts its whole node from both groups in one epoch.
        cluster.signal("y1", signal.SIGKILL)
        killed_at = time.time()
        time.sleep(0.5)
        for n in ("x0", "x1"):
            cluster.send(n, "reinit")
        after = {n: cluster.expect(n, "reinit", timeout=BOUND + 30) for n in ("x0", "x1")}
        assert after["x0"]["epoch"] == after["x1"]["epoch"] == joined["x0"]["epoch"] + 1
        assert all(r["world"] == 1 and r["changed"] for r in after.values())
        assert max(r["t"] for r in after.values()) - killed_at < BOUND
        cluster.send("y0", "check")
        err = cluster.expect("y0", "error", timeout=BOUND)
        assert err["type"] == "MeshEvicted" and "local rank 1" in err["msg"]
        cluster.send(["x0", "x1", "y0"], "exit")
    finally:
        coord.close()
