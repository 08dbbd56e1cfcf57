"""A node whose link is cut is evicted, and rejoins by itself when the link comes back.

Three prime-train nodes and the coordinator, each in its own network namespace of the WAN bed
(root only), started through the CLI (`prime-train`, `prime-mesh coordinator`) with their own
working folders. Node 2's link goes down (`ip link set eth0 down` in its namespace) for longer
than the heartbeat timeout while the run goes on; it is restored, and the same node process
rejoins through live recovery. The run syncs the model in two fragments in turn.
"""

import os
import signal
import subprocess
import sys

import pytest
from prime_netbed import WanBed, bed_unavailable_reason

from prime_testkit import folder_metrics, log_tails, outer_by_step, start_cli_node, wait_until

pytestmark = [
    pytest.mark.wan,
    pytest.mark.skipif(bed_unavailable_reason() is not None, reason=str(bed_unavailable_reason())),
]
TOKEN = "cut-link-test-token"
H = 10
STEPS = 200
NODES = 3
COORD = NODES  # the bed's last namespace holds the coordinator
PORT = 29500
# streaming outer steps (issue #26): two fragments, a sync every H/2 steps; the rejoiner enters
# the fragment cycle where the members are (plain rounds: test_join_ranks, test_stuck_node)
FRAGMENTS = ("--diloco.fragments", "2")


@pytest.mark.timeout(600)
def test_a_cut_link_evicts_the_node_and_it_rejoins_by_itself(tmp_path, children):
    cache = tmp_path / "token-cache"
    n = [tmp_path / f"node{k}" for k in range(NODES)]
    with WanBed(NODES + 1, rate_mbit=100) as bed:
        procs = []
        try:
            with open(tmp_path / "coordinator.log", "w") as out:
                coord = children.popen(
                    bed.exec_prefix(COORD)
                    + [sys.executable, "-m", "prime_mesh.cli", "coordinator",
                       "--host", bed.ip(COORD), "--port", str(PORT), "--min-nodes", str(NODES)],
                    env=dict(os.environ, PRIME_TOKEN=TOKEN), stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            procs = [
                start_cli_node(children, n[k], prefix=bed.exec_prefix(k), host=bed.ip(k),
                               coordinator=f"{bed.ip(COORD)}:{PORT}", token=TOKEN, cache=cache,
                               steps=STEPS, inner_steps=H, env={"GLOO_SOCKET_IFNAME": "eth0"},
                               args=FRAGMENTS)
                for k in range(NODES)
            ]  # fmt: skip
            running = lambda: all(p.poll() is None for p in procs)  # noqa: E731
            wait_until(lambda: 2 in outer_by_step(folder_metrics(n[2])) or not running(), 300,
                       what="node 2's second outer step")  # fmt: skip
            assert running(), log_tails(tmp_path)
            bed.link_down(2)
            try:
                cut_at = max(outer_by_step(folder_metrics(n[0])))
                # the others commit without node 2, twice, while its link is still down
                wait_until(lambda: sum(r["nodes"] == NODES - 1
                                       for k, r in outer_by_step(folder_metrics(n[0])).items()
                                       if k > cut_at) >= 2 or not running(), 180,
                           what="the others committing without node 2")  # fmt: skip
            finally:
                bed.link_up(2)
            outer0 = outer_by_step(folder_metrics(n[0]))
            alone = [k for k, r in outer0.items() if k > cut_at and r["nodes"] == NODES - 1]
            codes = [p.wait(timeout=400) for p in procs]
            coord.send_signal(signal.SIGTERM)  # the coordinator stops cleanly too
            codes.append(coord.wait(timeout=30))
        finally:
            for p in [*procs, *([coord] if "coord" in locals() else [])]:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=30)  # every process ends before its namespace is deleted
    assert codes == [0] * (NODES + 1), log_tails(tmp_path)
    assert len(alone) >= 2, log_tails(tmp_path)
    rows2 = folder_metrics(n[2])
    rejoined = [r for r in rows2 if r.get("rejoined")]
    assert [r["rejoined"] for r in rejoined] == [1], log_tails(tmp_path)
    assert rejoined[0]["fetch_bytes"] > 0 and rejoined[0]["donor"], rejoined
    entry = rejoined[0]["step"]
    after = [r for r in rows2 if "outer_sha256" in r and r["step"] >= entry]
    assert after and min(r["outer_step"] for r in after) > max(alone), log_tails(tmp_path)
    for member in n[:2]:
        theirs = outer_by_step(folder_metrics(member))
        for r in after:
            assert r["outer_sha256"] == theirs[r["outer_step"]]["outer_sha256"], r["outer_step"]
    back = outer_by_step(folder_metrics(n[0]))[min(r["outer_step"] for r in after)]
    assert back["nodes"] == NODES and back["contributors"] == NODES - 1, back
    assert "stalled or cut off" in (tmp_path / "coordinator.log").read_text()  # evicted
    log = (tmp_path / "node2.log").read_text()
    assert "lost the mesh membership" in log and "reentered the running job" in log, log[-3000:]
