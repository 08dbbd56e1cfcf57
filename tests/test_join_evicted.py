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
  holds only an older checkpoint than the one node 0 reported; it is evicted, waits for the
  node holding the run's newest state rather than roll the run back, and joins node 0 run
  again.
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
LISTENING = "listening (a member contributing nothing)"


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


def reported_checkpoint(coord: Coordinator, node_id: str) -> int:
    """The newest checkpoint step `node_id` reported to `coord` (-1: none yet)."""
    nodes = coord.page_status()["nodes"]
    return max((n["progress"].get("checkpoint", -1) for n in nodes if n["node_id"] == node_id),
               default=-1)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_listener_left_as_the_only_member_waits_for_the_node_holding_the_newest_state(
    tmp_path, token_cache, children
):
    """Node 0 founds the run (`--min-nodes 1`); node 1 joins, checkpoints and is SIGKILLed;
    node 0 goes on alone and reports newer checkpoints. Node 1, run again, listens while its
    snapshot comes (`--mesh.fetch_mbit 8`: ~10 s), and node 0 is SIGKILLed: node 1 is the
    only member and listening, so the coordinator evicts it ("only listening"); it registers
    again as a founder holding only its older checkpoint, behind the newest one node 0
    reported, and waits (`NothingToFormFrom`) instead of rolling the run back. Node 0, run
    again, resumes from its newest checkpoint and node 1 joins it. Churn pass 4, seed 5: the
    listeners left as the only members re-formed the run from a checkpoint 25 outer steps
    behind, and the nodes' rows carried two hashes per outer step."""
    folders = [tmp_path / f"node{k}" for k in range(2)]
    log1 = tmp_path / "node1.log"
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    steps = 300  # node 1's second join (its snapshot: ~10 s) ends before node 0's run does
    node = {"coordinator": coord.address, "cache": token_cache, **NODE, "steps": steps}
    try:
        p0 = start_cli_node(children, folders[0], **node)
        wait_until(lambda: 1 in outer_by_step(folder_metrics(folders[0])), 120,
                   what="node 0's outer step 1")  # fmt: skip
        p1 = start_cli_node(children, folders[1], **node)
        wait_until(lambda: reported_checkpoint(coord, "node1") > 0, 120,
                   what="node 1 reporting a checkpoint")  # fmt: skip
        p1.kill()
        p1.wait(30)
        first_life = folder_metrics(folders[1])
        older = max(r.get("ckpt_step") or 0 for r in first_life)
        wait_until(lambda: reported_checkpoint(coord, "node0") > older, 120,
                   what="node 0 reporting a newer checkpoint than node 1's")  # fmt: skip
        listening = log1.read_text().count(LISTENING)
        p1 = start_cli_node(children, folders[1], **node, args=["--mesh.fetch_mbit", "8"])
        wait_until(lambda: log1.read_text().count(LISTENING) > listening, 120,
                   what="node 1 listening again")  # fmt: skip
        p0.kill()
        p0.wait(30)
        newest = reported_checkpoint(coord, "node0")
        wait_until(lambda: "reported holding the step-" in log1.read_text()
                   or p1.poll() is not None, 120, what="node 1 waiting for node 0")  # fmt: skip
        p0 = start_cli_node(children, folders[0], **node)
        codes = [wait_exit(p, 240, tmp_path / f"node{k}.log") for k, p in enumerate((p0, p1))]
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    text1 = log1.read_text()
    assert "only listening" in text1, text1[-3000:]
    assert f"node0 reported holding the step-{newest} checkpoint" in text1, text1[-3000:]
    resumed = re.findall(
        r"resumed from the step-(\d+) checkpoint", folders[0].with_suffix(".log").read_text()
    )
    assert resumed and int(resumed[-1]) >= newest > older, resumed  # no roll-back
    joined = [r for r in folder_metrics(folders[1]) if r.get("joined")]
    assert len(joined) == 2 and joined[-1]["step"] >= newest, joined  # each life joined once
    again = [r for r in folder_metrics(folders[1])[len(first_life) :] if "outer_step" in r]
    assert again and all(r["step"] >= joined[-1]["step"] for r in again)  # no run of its own
    outer0 = outer_by_step(folder_metrics(folders[0]))
    assert max(outer0) == steps // H and outer0[steps // H]["nodes"] == 2
    assert all(r["outer_sha256"] == outer0[r["outer_step"]]["outer_sha256"] for r in again)
