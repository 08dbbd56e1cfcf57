"""A joiner sent away before it was admitted registers again and joins, through the CLI
(each node its own process and folder; a coordinator in the test process).

Node 1 joins node 0's running job; it holds its `ready()` a while (the fault hook
`PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S`), and there
- the test SIGSTOPs it past the heartbeat timeout: the coordinator evicts it before its
  admission. On SIGCONT it must not exit with the library's `MeshEvicted` but register again,
  join, and end with node 0's outer weights;
- or (node 2, joining the run of nodes 0 and 1) every member stops (SIGTERM): the run has
  nobody left to join. Node 2 is sent away and registers again as a founder; node 0, run
  again with the same command, founds the run with it and resumes from its checkpoint, the
  newest, and node 2 joins it (issue #33, churn seed 21);
- or node 1 listens to node 0's rounds and node 0 is SIGKILLed: node 1 is the only member and
  holds none of the run's state; it is evicted, waits for a node with the run's state, and
  joins node 0 run again.
"""

import re
import signal
from pathlib import Path

import pytest

from prime_mesh import Coordinator
from prime_testkit import (
    folder_metrics,
    log_tails,
    outer_by_step,
    start_cli_node,
    wait_exit,
    wait_until,
)

TOKEN = "join-evicted-test-token"
H = 10
STEPS = 200  # node 0 alone takes about a minute: node 1 joins well before its end
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": STEPS, "inner_steps": H}
HOLD = {"PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S": "8"}
NOTHING = "no node forming it anew holds a checkpoint"  # NothingToFormFrom, then again


def start_joiner_once_outer_step(
    children, coord, tmp_path: Path, cache: Path, k: int, joiner: int = 1, **node
):
    """Node `joiner`, started once node 0 committed outer step `k`; returns its process once
    it holds its `ready()` (node j's folder: tmp_path/node{j})."""
    n0, folder = tmp_path / "node0", tmp_path / f"node{joiner}"
    wait_until(lambda: k in outer_by_step(folder_metrics(n0)), 120,
               what=f"node 0's outer step {k}")  # fmt: skip
    p = start_cli_node(children, folder, coordinator=coord.address, cache=cache, env=HOLD,
                       **node)  # fmt: skip
    log = folder.with_suffix(".log")
    wait_until(lambda: "holding ready()" in log.read_text() or p.poll() is not None,
               120, what=f"node {joiner} holding its ready()")  # fmt: skip
    return p


def same_weights_from_entry(tmp_path: Path, joiner: int = 1) -> dict:
    """The joiner's outer rows from its entry on, checked against node 0's (one `joined`
    row, returned)."""
    outer0 = outer_by_step(folder_metrics(tmp_path / "node0"))
    outer1 = outer_by_step(folder_metrics(tmp_path / f"node{joiner}"))
    assert max(outer1) == max(outer0) == STEPS // H, log_tails(tmp_path)
    joined = [r for r in folder_metrics(tmp_path / f"node{joiner}") if r.get("joined")]
    assert len(joined) == 1 and joined[0]["fetch_bytes"] > 0, joined
    after = [k for k, r in outer1.items() if r["step"] >= joined[0]["step"]]
    assert after and all(outer1[k]["outer_sha256"] == outer0[k]["outer_sha256"] for k in after)
    assert outer0[STEPS // H]["nodes"] == 2
    return joined[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_joiner_evicted_before_admission_joins_again(tmp_path, token_cache, children):
    n0 = tmp_path / "node0"
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    try:
        p0 = start_cli_node(children, n0, coordinator=coord.address, cache=token_cache, **NODE)
        p1 = start_joiner_once_outer_step(children, coord, tmp_path, token_cache, 1, **NODE)
        p1.send_signal(signal.SIGSTOP)
        try:  # evicted as a joiner: no new epoch, an event on the page
            wait_until(lambda: any(e["kind"] == "evicted" for e in coord.page_status()["events"]),
                       60, what="node 1 evicted before its admission")  # fmt: skip
        finally:
            p1.send_signal(signal.SIGCONT)
        codes = [p.wait(timeout=240) for p in (p0, p1)]
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    # The eviction reaches it as MeshEvicted (it then registers again, saying so) or, when
    # the coordinator's closing of its connection comes first, through its client's own
    # reconnection; either way it must not end with the library's MeshEvicted line
    log = (tmp_path / "node1.log").read_text()
    assert "close() this mesh" not in log or "lost its place while joining" in log, log[-3000:]
    same_weights_from_entry(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_joiner_whose_run_lost_every_member_forms_it_anew_with_a_node_back(
    tmp_path, token_cache, children
):
    """Two founders (the coordinator's min_nodes 2) that serve snapshots at 0.2 Mbit/s, node
    2 joining; both founders stop before its snapshot can come. Node 2 is sent away,
    registers again as a founder holding nothing and waits for a second one (no run of its
    own). Node 0, run again at the usual rate, holds the newest checkpoint (its stop's): it
    founds the run with node 2, which lacks that step and joins it. Churn seed 21 (issue
    #33): such a node waited for members forever."""
    folders = [tmp_path / f"node{k}" for k in range(3)]
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    node = {"coordinator": coord.address, "cache": token_cache, **NODE}
    try:
        slow = {**node, "args": ["--mesh.serve_mbit", "0.2"]}  # the 8.7 MB snapshot: ~6 min
        p0, p1 = (start_cli_node(children, f, **slow) for f in folders[:2])
        p2 = start_joiner_once_outer_step(children, coord, tmp_path, token_cache, 2, 2, **NODE)
        for p in (p0, p1):  # every member leaves while node 2 joins
            p.send_signal(signal.SIGTERM)
        stopped = [wait_exit(p, 120, tmp_path / f"node{k}.log") for k, p in enumerate((p0, p1))]
        log2 = tmp_path / "node2.log"
        wait_until(lambda: "lost its place while joining" in log2.read_text()
                   or p2.poll() is not None, 120, what="node 2 sent away")  # fmt: skip
        p0 = start_cli_node(children, folders[0], **node)
        codes = [wait_exit(p, 240, tmp_path / f"node{k}.log") for k, p in ((0, p0), (2, p2))]
    finally:
        coord.close()
    assert stopped + codes == [0, 0, 0, 0], log_tails(tmp_path)
    log0, log2 = folders[0].with_suffix(".log").read_text(), log2.read_text()
    assert "forming it anew" in log2, log2[-3000:]
    resumed = re.search(r"resumed from the step-(\d+) checkpoint", log0)  # (its second life)
    assert resumed, log0[-3000:]
    newest = int(resumed.group(1))
    assert f"founding node(s) hold step {newest}" in log2, log2[-3000:]
    joined = [r for r in folder_metrics(folders[2]) if r.get("joined")]
    assert len(joined) == 1 and joined[0]["fetch_bytes"] > 0 and joined[0]["step"] >= newest
    outer0, outer2 = (outer_by_step(folder_metrics(folders[k])) for k in (0, 2))
    assert all(r["step"] >= joined[0]["step"] for r in outer2.values())  # no run of its own
    after = [k for k, r in outer2.items() if r["step"] > newest]
    assert max(outer0) == max(outer2) == STEPS // H and outer0[STEPS // H]["nodes"] == 2
    assert after and all(outer2[k]["outer_sha256"] == outer0[k]["outer_sha256"] for k in after)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_listener_left_as_the_only_member_forms_the_run_anew_with_a_node_back(
    tmp_path, token_cache, children
):
    """Node 0 founds the run and serves snapshots at 0.2 Mbit/s; node 1 joins and listens
    while its snapshot comes. Node 0 is SIGKILLed: node 1 is the only member and holds none
    of the run's state. At its next sync point the coordinator finds every member listening
    and evicts it ("only listening"): it registers again, holds no checkpoint, and waits
    (`NothingToFormFrom`) instead of running the run on with nobody's state. Node 0, run
    again, resumes from its checkpoint and node 1 joins it. Churn pass 2 of stop 42, seed 3:
    such a run committed empty rounds for 15 minutes."""
    folders = [tmp_path / f"node{k}" for k in range(2)]
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    node = {"coordinator": coord.address, "cache": token_cache, **NODE}
    try:
        p0 = start_cli_node(children, folders[0], **node, args=["--mesh.serve_mbit", "0.2"])
        wait_until(lambda: 2 in outer_by_step(folder_metrics(folders[0])), 120,
                   what="node 0's outer step 2")  # fmt: skip
        p1 = start_cli_node(children, folders[1], **node)
        log1 = tmp_path / "node1.log"
        wait_until(lambda: "listening (a member contributing nothing)" in log1.read_text(), 120,
                   what="node 1 listening")  # fmt: skip
        p0.kill()
        p0.wait(30)
        wait_until(lambda: NOTHING in log1.read_text() or p1.poll() is not None, 120,
                   what="node 1 evicted as the only, listening member, holding nothing")  # fmt: skip
        p0 = start_cli_node(children, folders[0], **node)
        codes = [wait_exit(p, 240, tmp_path / f"node{k}.log") for k, p in enumerate((p0, p1))]
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    log1 = log1.read_text()
    assert "only listening" in log1, log1[-3000:]
    joined = [r for r in folder_metrics(folders[1]) if r.get("joined")]
    assert len(joined) == 1 and joined[0]["fetch_bytes"] > 0, joined
    outer0, outer1 = (outer_by_step(folder_metrics(f)) for f in folders)
    assert all(r["step"] >= joined[0]["step"] for r in outer1.values())  # no run of its own
    assert max(outer0) == max(outer1) == STEPS // H
    assert all(outer1[k]["outer_sha256"] == outer0[k]["outer_sha256"] for k in outer1)
