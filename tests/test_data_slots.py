"""Exactly-once data under churn, through the CLI: a joiner, a SIGKILLed node run again and a
SIGSTOPped node that rejoins by itself; then, from every node's committed outer-step rows,
each data slot's counted reads are one unbroken chain from 0 (no sequence read twice, none
skipped) and every slot keeps advancing. Each node is its own process in its own folder."""

import signal
import subprocess
from pathlib import Path

import pytest

from prime_mesh import Coordinator
from prime_testkit import (
    clean_env,
    debug_args,
    folder_metrics,
    log_tails,
    outer_by_step,
    outer_rows,
    slot_chain_problems,
    start_cli_node,
    start_nodes_in_turn,
    wait_until,
)
from prime_testkit.cli_node import CLI

TOKEN = "data-slots-test-token"
SLOTS = 12
# long enough never to end by itself: the test stops the nodes (SIGTERM) after its last event
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": 5000, "inner_steps": 10,
        "args": ["--data.slots", str(SLOTS)]}  # fmt: skip


def all_reads(folders: list[Path]) -> list[dict]:
    """Every node's outer-step rows, each naming its node."""
    return [{**r, "node": k} for k, f in enumerate(folders) for r in outer_rows(folder_metrics(f))]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_every_slot_is_read_once_in_order_through_join_kill_and_stall(
    tmp_path, token_cache, children
):
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    folders = [tmp_path / f"node{k}" for k in range(3)]
    try:
        nodes = dict(enumerate(start_nodes_in_turn(children, folders[:2], coord,
                                                   cache=token_cache, **NODE)))  # fmt: skip

        def outer_of(k: int) -> int:
            return max(outer_by_step(folder_metrics(folders[k])), default=0)

        def wait_outer(k: int, n: int, what: str, alive: tuple[int, ...] = (0, 1, 2)) -> None:
            live = [nodes[i] for i in alive if i in nodes]
            wait_until(lambda: outer_of(k) >= n or any(p.poll() is not None for p in live),
                       240, what=what)  # fmt: skip
            assert all(p.poll() is None for p in live), log_tails(tmp_path)

        wait_outer(0, 2, "the founders' second outer step")
        nodes[2] = start_cli_node(children, folders[2], coordinator=coord.address,
                                  cache=token_cache, **NODE)  # fmt: skip
        wait_until(lambda: any(r.get("joined") for r in folder_metrics(folders[2]))
                   or nodes[2].poll() is not None, 240, what="the joiner's entry")  # fmt: skip
        wait_outer(2, outer_of(0) + 2, "the joiner's second counted round")
        # killed just after it recorded a round, so mid-round: its reads of the next round
        # never count (killed between a vote and its row, its counted reads would show in no
        # row: CI46 caught such a kill, the others then read on from where its round left)
        wait_outer(1, outer_of(1) + 1, "node 1 recording its next round")
        nodes[1].send_signal(signal.SIGKILL)
        nodes[1].wait(timeout=30)
        wait_outer(0, outer_of(0) + 2, "the others going on without node 1", alive=(0, 2))
        nodes[1] = start_cli_node(children, folders[1], coordinator=coord.address,
                                  cache=token_cache, **NODE)  # fmt: skip
        wait_until(lambda: sum(bool(r.get("joined")) for r in folder_metrics(folders[1])) >= 1
                   or nodes[1].poll() is not None, 240, what="node 1 back in")  # fmt: skip
        wait_outer(1, outer_of(0) + 1, "node 1's first round back")
        nodes[2].send_signal(signal.SIGSTOP)  # evicted, then rejoins by itself
        try:
            stalled = outer_of(0)
            wait_until(lambda: outer_of(0) >= stalled + 2, 120, what="the others without node 2")
        finally:
            nodes[2].send_signal(signal.SIGCONT)
        wait_until(lambda: any(r.get("rejoined") for r in folder_metrics(folders[2]))
                   or nodes[2].poll() is not None, 240, what="node 2 rejoining")  # fmt: skip
        wait_outer(2, outer_of(0) + 1, "node 2's first round back")
        for p in nodes.values():  # each stops at its next outer boundary
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in nodes.values()]
    finally:
        coord.close()
    assert codes == [0, 0, 0], log_tails(tmp_path)
    assert slot_chain_problems(all_reads(folders), SLOTS, stall=3) == []
    # the joiner's entry round and the killed node's last round count nothing
    entries = [r for f in folders for r in folder_metrics(f) if r.get("joined")]
    assert len(entries) >= 3, entries
    for folder in folders:
        hashes = {k: r["outer_sha256"] for k, r in outer_by_step(folder_metrics(folder)).items()}
        theirs = outer_by_step(folder_metrics(folders[0]))
        assert all(theirs[k]["outer_sha256"] == h for k, h in hashes.items() if k in theirs)
    # the new node and the killed one run again each entered through live recovery: a member's
    # state fetched (not node 1's own older checkpoint), an entry round of three members in
    # which the one entering contributed nothing, and the members' hash from there on
    theirs = outer_by_step(folder_metrics(folders[0]))
    for k in (1, 2):
        entry = [r for r in folder_metrics(folders[k]) if r.get("joined") and not r.get("rejoined")]
        assert entry and entry[-1]["fetch_bytes"] > 0 and entry[-1]["donor"], entry
        first = min(r["outer_step"] for r in outer_by_step(folder_metrics(folders[k])).values()
                    if r["step"] >= entry[-1]["step"])  # fmt: skip
        assert theirs[first]["nodes"] == 3 and theirs[first]["contributors"] < 3, theirs[first]
        log = folders[k].with_suffix(".log").read_text()
        assert "entered the running job at outer step" in log and "MB/s" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_evicted_after_its_vote_passed_still_records_that_round(
    tmp_path, token_cache, children
):
    """Node 1's training thread blocks once the vote of outer step 2 passed (a fault hook; its
    heartbeats go on) until node 0 has left it out and committed twice alone. Round 2 is
    committed on both nodes with node 1's reads, so node 1 writes its row when it wakes, though
    it learns of its eviction meanwhile (CI once lost that row: a node SIGSTOPped just after
    its vote skipped it, and a slot's chain had a gap); then it rejoins by itself."""
    release = tmp_path / "release-node1"
    stall = {"PRIME_TRAIN_FAULT_STALL_AFTER_VOTE": "2", "PRIME_TRAIN_FAULT_STALL_S": "200",
             "PRIME_TRAIN_FAULT_STALL_UNTIL": str(release)}  # fmt: skip
    node = {**NODE, "args": [*NODE["args"], "--diloco.sync_timeout_s", "3"]}
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    folders = [tmp_path / f"node{k}" for k in range(2)]
    try:
        nodes = [start_cli_node(children, folders[0], coordinator=coord.address,
                                cache=token_cache, **node)]  # fmt: skip
        wait_until(lambda: len(coord.status()["nodes"]) == 1, 120, what="node 0 registers")
        nodes.append(start_cli_node(children, folders[1], coordinator=coord.address,
                                    cache=token_cache, env=stall, **node))  # fmt: skip
        alone = lambda: [r for r in outer_by_step(folder_metrics(folders[0])).values()  # noqa: E731
                         if r["nodes"] == 1 and r["outer_step"] > 2]  # fmt: skip
        wait_until(lambda: len(alone()) >= 2 or any(p.poll() is not None for p in nodes), 240,
                   what="node 0 committing alone after leaving node 1 out")  # fmt: skip
        assert all(p.poll() is None for p in nodes), log_tails(tmp_path)
        release.touch()
        back = lambda: [r for r in folder_metrics(folders[1]) if r.get("rejoined")]  # noqa: E731
        wait_until(lambda: back() or nodes[1].poll() is not None, 240, what="node 1 rejoining")
        wait_until(lambda: max(outer_by_step(folder_metrics(folders[1]))) > back()[-1]["step"]
                   // NODE["inner_steps"] or nodes[1].poll() is not None, 240,
                   what="node 1's first round back")  # fmt: skip
        for p in nodes:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in nodes]
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    mine = outer_by_step(folder_metrics(folders[1]))
    theirs = outer_by_step(folder_metrics(folders[0]))
    assert mine[2]["data"] and mine[2]["nodes"] == 2, mine[2]  # the round it voted for
    assert mine[2]["outer_sha256"] == theirs[2]["outer_sha256"]
    log = folders[1].with_suffix(".log").read_text()
    assert "after the vote of outer step 2" in log and "evicted" in log, log[-3000:]
    assert slot_chain_problems(all_reads(folders), SLOTS, stall=3) == []


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_run_with_more_nodes_than_data_slots_is_refused(tmp_path, token_cache):
    args = debug_args(tmp_path / "runs", token_cache, "--launch.local_nodes", "2",
                      "--data.slots", "1", "--train.steps", "20")  # fmt: skip
    r = subprocess.run([*CLI, *args], env=clean_env(PRIME_TOKEN=TOKEN), capture_output=True,
                       text=True, timeout=180)  # fmt: skip
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert "2 nodes but data.slots = 1" in r.stdout + r.stderr
