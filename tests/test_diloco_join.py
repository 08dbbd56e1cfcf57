"""Nodes rejoining a running prime-train job by themselves through live checkpoint recovery,
through the CLI (a new node joining and a killed node run again: tests/test_data_slots.py).

Each node is its own process with its own working folder (runs_dir and checkpoints), as on
its own machine, started with the same command; a coordinator runs in the test process.
"""

import signal
from pathlib import Path

import pytest

from prime_mesh import Coordinator
from prime_testkit import (
    folder_metrics,
    log_tails,
    outer_by_step,
    start_cli_node,
    wait_until,
)

TOKEN = "diloco-join-test-token"
H = 10
STEPS = 240
# each node as prime_testkit.cli_node has it (a checkpoint every 40 steps, not at every
# boundary: a waiting joiner asks for one), in its own folder node{k}/, logging to node{k}.log
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": STEPS, "inner_steps": H}
DELAYED = ["--diloco.overlap", "delayed"]


def start_pair(children, tmp_path, coord, cache, args=()):
    nodes = {}
    for k in range(2):
        nodes[k] = start_cli_node(children, tmp_path / f"node{k}", coordinator=coord.address,
                                  cache=cache, args=list(args), **NODE)  # fmt: skip
        wait_until(lambda n=k: len(coord.status()["nodes"]) > n, 120, what=f"node {k} registers")
    return nodes


def check_rejoined(tmp_path, node: Path, members: list[Path], times: int = 1) -> int:
    """The node's rows say it rejoined `times` times by itself, the last entry fetched a
    member's state, and from that entry on every outer step has the members' hash. Returns
    the inner step it re-entered at."""
    rejoined = [r for r in folder_metrics(node) if r.get("rejoined")]
    assert [r["rejoined"] for r in rejoined] == list(range(1, times + 1)), log_tails(tmp_path)
    last = rejoined[-1]
    assert last["joined"] and last["fetch_bytes"] > 0 and last["donor"], last
    after = [r for r in folder_metrics(node) if "outer_sha256" in r and r["step"] >= last["step"]]
    assert after, log_tails(tmp_path)
    for m in members:
        theirs = outer_by_step(folder_metrics(m))
        for r in after:
            assert r["outer_sha256"] == theirs[r["outer_step"]]["outer_sha256"], (
                r["outer_step"],
                log_tails(tmp_path),
            )
    return int(last["step"])


def stall_node_1_until_node_0_goes_on_alone(nodes, n0: Path, n1: Path) -> int:
    """SIGSTOP node 1 after its second outer step, SIGCONT it once node 0 committed alone;
    returns node 0's last outer step before the stall."""
    wait_until(lambda: all(2 in outer_by_step(folder_metrics(n)) for n in (n0, n1))
               or nodes[1].poll() is not None, 240, what="both nodes' second outer step")  # fmt: skip
    nodes[1].send_signal(signal.SIGSTOP)
    try:
        stalled_at = max(outer_by_step(folder_metrics(n0)))
        wait_until(lambda: any(r["nodes"] == 1 for k, r in outer_by_step(folder_metrics(n0)).items()
                               if k > stalled_at)
                   or nodes[0].poll() is not None, 120, what="node 0 going on alone")  # fmt: skip
    finally:
        nodes[1].send_signal(signal.SIGCONT)
    return stalled_at


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stalled_node_is_evicted_and_rejoins_by_itself(tmp_path, token_cache, children):
    """SIGSTOP a node past the heartbeat timeout, SIGCONT it: evicted, it rejoins through live
    recovery without being restarted (the same process), and ends with the member's weights.
    With `overlap = "delayed"`: the stalled node's round in flight crosses the loss (a
    synchronous run's stall and rejoin: tests/test_data_slots.py)."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        nodes = start_pair(children, tmp_path, coord, token_cache, DELAYED)
        n0, n1 = tmp_path / "node0", tmp_path / "node1"
        stalled_at = stall_node_1_until_node_0_goes_on_alone(nodes, n0, n1)
        outer0 = outer_by_step(folder_metrics(n0))
        alone = [k for k, r in outer0.items() if k > stalled_at and r["nodes"] == 1]
        codes = [p.wait(timeout=300) for p in (nodes[0], nodes[1])]
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    assert alone, log_tails(tmp_path)  # the member committed while the straggler was out
    entry = check_rejoined(tmp_path, n1, [n0])
    rows1 = folder_metrics(n1)
    back = min(r["outer_step"] for r in rows1 if "outer_sha256" in r and r["step"] >= entry)
    assert back > max(alone)  # it re-entered after the rounds it missed, not in their place
    outer0, outer1 = outer_by_step(folder_metrics(n0)), outer_by_step(rows1)
    assert outer0[back]["nodes"] == 2 and outer0[back]["contributors"] == 1
    log = (tmp_path / "node1.log").read_text()
    assert "lost the mesh membership" in log and "reentered the running job" in log, log[-3000:]
    assert outer1[max(outer1)]["outer_sha256"] == outer0[max(outer0)]["outer_sha256"]
    assert outer0[max(outer0)]["nodes"] == 2
