"""A node stuck while it heartbeats never freezes the run, through the CLI.

Three prime-train nodes, each its own process and working folder, and a coordinator in the
test process. Node 2's training thread blocks before inner step STALL_AT (a fault hook: its
heartbeat thread goes on, so the coordinator sees it alive). The others reach the next sync
point, are held there at most `diloco.sync_timeout_s`, then leave node 2 out (evicted) and
commit on without it. Released, node 2 finds itself left out at its own sync point and
rejoins through live recovery; every node ends with the same outer weights. With
`diloco.max_missed_rounds = 1` a node left out once exits 1 instead.
"""

from pathlib import Path

import pytest

from prime_mesh import Coordinator
from prime_testkit import folder_metrics, log_tails, outer_by_step, start_cli_node, wait_until

TOKEN = "stuck-node-test-token"
H = 10
STEPS = 100  # node 2 is back by step 60: the members' round after their checkpoint for it
SYNC_TIMEOUT_S = 6
STALL_AT = 25  # node 2 blocks mid-round: the others wait for it at step 30's sync point
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": STEPS, "inner_steps": H,
        "args": ["--diloco.sync_timeout_s", str(SYNC_TIMEOUT_S)]}  # fmt: skip


def left_out_rounds(folder: Path) -> list[int]:
    """The inner steps whose outer step the node committed with the other member only."""
    return sorted(r["step"] for r in outer_by_step(folder_metrics(folder)).values()
                  if r["nodes"] == 2)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stuck_heartbeating_node_is_left_out_and_rejoins(tmp_path, token_cache, children):
    n = [tmp_path / f"node{k}" for k in range(3)]
    release = tmp_path / "release-node2"
    stall = {"PRIME_TRAIN_FAULT_STALL_AT_STEP": str(STALL_AT), "PRIME_TRAIN_FAULT_STALL_S": "200",
             "PRIME_TRAIN_FAULT_STALL_UNTIL": str(release)}  # fmt: skip
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=3).start()
    try:
        procs = []
        for k in range(3):  # one after the other, as the other CLI tests: three nodes starting
            # (and the first building the token cache) at once starve heartbeats on 2 cores
            procs.append(
                start_cli_node(
                    children,
                    n[k],
                    coordinator=coord.address,
                    cache=token_cache,
                    env=stall if k == 2 else {},
                    **NODE,
                )
            )
            wait_until(
                lambda k=k: len(coord.status()["nodes"]) > k, 120, what=f"node {k} registers"
            )
        running = lambda: all(p.poll() is None for p in procs)  # noqa: E731
        # the others commit twice without node 2 while it is still blocked
        wait_until(lambda: len(left_out_rounds(n[0])) >= 2 or not running(), 240,
                   what="nodes 0 and 1 committing without node 2")  # fmt: skip
        assert running(), log_tails(tmp_path)
        release.touch()
        codes = [p.wait(timeout=300) for p in procs]
        events = coord.page_status()["events"]
    finally:
        coord.close()
    assert codes == [0, 0, 0], log_tails(tmp_path)

    # left out by the sync timeout at the first sync point it missed (its heartbeats went on)
    evicted = [e for e in events if e["kind"] == "evicted"]  # (at the end, all leave)
    assert len(evicted) == 1 and evicted[0]["node_id"] == "node2", events
    assert "did not reach the sync point within 6.0s" in evicted[0]["reason"], evicted
    left_out = left_out_rounds(n[0])
    assert left_out[0] == (STALL_AT // H + 1) * H, left_out
    assert left_out == left_out_rounds(n[1])

    # the committing nodes agree at every outer step
    outer0, outer1 = outer_by_step(folder_metrics(n[0])), outer_by_step(folder_metrics(n[1]))
    assert outer0.keys() == outer1.keys()
    assert all(outer0[k]["outer_sha256"] == outer1[k]["outer_sha256"] for k in outer0)
    assert outer0[max(outer0)]["nodes"] == 3  # node 2 is back by the end

    # node 2 rejoined once, through a member's state, and from then on holds their weights
    rows2 = folder_metrics(n[2])
    rejoined = [r for r in rows2 if r.get("rejoined")]
    assert [r["rejoined"] for r in rejoined] == [1], log_tails(tmp_path)
    assert rejoined[0]["fetch_bytes"] > 0 and rejoined[0]["donor"], rejoined
    after = [r for r in rows2 if "outer_sha256" in r and r["step"] >= rejoined[0]["step"]]
    assert after and min(r["step"] for r in after) > max(left_out), log_tails(tmp_path)
    for r in after:  # the members' weights, at the members' step (its position too)
        assert r["outer_sha256"] == outer0[r["outer_step"]]["outer_sha256"], r["outer_step"]
        assert r["step"] == outer0[r["outer_step"]]["step"], (r["outer_step"], r["step"])
    before = [r for r in rows2 if "outer_sha256" in r and r["step"] < STALL_AT]
    assert before and all(r["outer_sha256"] == outer0[r["outer_step"]]["outer_sha256"]
                          for r in before)  # fmt: skip
    log = (tmp_path / "node2.log").read_text()
    assert "lost the mesh membership" in log and "did not reach the sync point" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_left_out_max_missed_rounds_in_a_row_exits_1(tmp_path, token_cache, children):
    """With `diloco.max_missed_rounds = 1` the stuck node, once left out, does not rejoin: it
    says why and exits 1, and the other node commits on alone. (The bound of the other
    losses, `diloco.max_rejoins`: packages/prime-train/tests/test_rejoin.py.)"""
    n = [tmp_path / f"node{k}" for k in range(2)]
    release = tmp_path / "release-node1"
    stall = {"PRIME_TRAIN_FAULT_STALL_AT_STEP": str(STALL_AT), "PRIME_TRAIN_FAULT_STALL_S": "200",
             "PRIME_TRAIN_FAULT_STALL_UNTIL": str(release)}  # fmt: skip
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        procs = []
        for k in range(2):
            extra = ["--diloco.max_missed_rounds", "1"] if k == 1 else []
            node = {**NODE, "args": [*NODE["args"], *extra]}
            procs.append(start_cli_node(children, n[k], coordinator=coord.address,
                                        cache=token_cache, env=stall if k == 1 else {}, **node))  # fmt: skip
            wait_until(
                lambda k=k: len(coord.status()["nodes"]) > k, 120, what=f"node {k} registers"
            )
        alone = lambda: [r for r in outer_by_step(folder_metrics(n[0])).values()  # noqa: E731
                         if r["nodes"] == 1]  # fmt: skip
        wait_until(lambda: alone() or procs[0].poll() is not None, 240,
                   what="node 0 committing without node 1")  # fmt: skip
        release.touch()
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        coord.close()
    assert codes == [0, 1], log_tails(tmp_path)
    log = (tmp_path / "node1.log").read_text()
    assert "left out of 1 rounds in a row" in log and "diloco.max_missed_rounds = 1" in log, log[
        -3000:
    ]
    assert not [r for r in folder_metrics(n[1]) if r.get("rejoined")]
    outer0 = outer_by_step(folder_metrics(n[0]))
    assert alone()[0]["step"] == (STALL_AT // H + 1) * H  # left out at its first missed round
    assert outer0[max(outer0)]["nodes"] == 1 and max(outer0) == STEPS // H
