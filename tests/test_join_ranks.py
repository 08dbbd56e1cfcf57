"""A node of two ranks joins a running job of two such nodes (issue #24): each rank of the
joiner loads its shard of the members' snapshot, replays its shard of their updates, and the
node enters with every shard's hash equal to theirs. A stalled two-rank node, evicted,
rejoins by itself the same way. Through the CLI, each node's ranks
started as torchrun starts them, each node in its own folder.
"""

import signal

import pytest

from prime_mesh import Coordinator
from prime_testkit import folder_metrics, log_tails, outer_by_step, start_ranked_node, wait_until

TOKEN = "join-ranks-test-token"
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": 5000, "inner_steps": 10,
        "args": ["--data.seq_len", "64", "--train.batch_size", "4", "--mesh.serve_mbit", "4"]}  # fmt: skip
DELAYED = ("--diloco.overlap", "delayed")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_node_of_two_ranks_joins_two_running_ones(tmp_path, token_cache, children):
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    n0, n1, n2 = (tmp_path / f"node{k}" for k in range(3))
    try:
        nodes = _start_two_ranked_nodes(children, coord, token_cache, (n0, n1))
        everyone = [p for ranks in nodes for p in ranks]
        wait_until(lambda: 1 in outer_by_step(folder_metrics(n0))
                   or any(p.poll() is not None for p in everyone), 240,
                   what="the members' first outer step")  # fmt: skip
        assert all(p.poll() is None for p in everyone), log_tails(tmp_path)
        joiner = start_ranked_node(children, n2, 2, coordinator=coord.address, cache=token_cache,
                                   **NODE)  # fmt: skip
        everyone += joiner

        def joiner_contributed() -> bool:
            rows = outer_by_step(folder_metrics(n0)).values()
            return any(r["contributors"] == 3 for r in rows) or any(
                p.poll() is not None for p in everyone
            )

        wait_until(joiner_contributed, 300, what="a round the joiner contributed to")
        for ranks in (*nodes, joiner):  # each node stops at its next outer boundary
            ranks[0].send_signal(signal.SIGTERM)
            ranks[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in everyone]
    finally:
        coord.close()
    assert codes == [0] * 6, log_tails(tmp_path)
    joined = [r for r in folder_metrics(n2) if r.get("joined")]
    assert len(joined) == 1, log_tails(tmp_path)
    mine = outer_by_step(folder_metrics(n2))
    assert mine, log_tails(tmp_path)
    for m in (n0, n1):
        theirs = outer_by_step(folder_metrics(m))
        shared = [k for k in mine if k in theirs]
        assert min(mine) in shared and len(shared) >= 2, log_tails(tmp_path)
        for k in shared:  # every rank's shard, and the node's hash
            assert len(mine[k]["shard_sha256"]) == 2, mine[k]
            assert mine[k]["shard_sha256"] == theirs[k]["shard_sha256"], (k, log_tails(tmp_path))
            assert mine[k]["outer_sha256"] == theirs[k]["outer_sha256"], (k, log_tails(tmp_path))
    assert any(r["contributors"] == 3 for r in outer_by_step(folder_metrics(n0)).values())


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_stalled_node_of_two_ranks_is_evicted_and_rejoins_by_itself(
    tmp_path, token_cache, children
):
    """Both ranks of a two-rank node SIGSTOPped past the heartbeat timeout, then SIGCONTed:
    evicted, the node rejoins by itself (the same processes), each rank listening with its
    shard and catching up, and contributes again with every shard's hash equal to the
    member's. With `overlap = "delayed"`: the stalled node's round in flight crosses the loss
    (a synchronous run's stall and rejoin: tests/test_data_slots.py). 44-60 s on 2 cores."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    n0, n1 = tmp_path / "node0", tmp_path / "node1"
    try:
        nodes = _start_two_ranked_nodes(children, coord, token_cache, (n0, n1), DELAYED)
        everyone = [p for ranks in nodes for p in ranks]

        def both_at(step: int) -> bool:
            done = [outer_by_step(folder_metrics(n)) for n in (n0, n1)]
            return all(step in d for d in done) or any(p.poll() is not None for p in everyone)

        wait_until(lambda: both_at(2), 240, what="both nodes' second outer step")
        assert all(p.poll() is None for p in everyone), log_tails(tmp_path)
        for p in nodes[1]:
            p.send_signal(signal.SIGSTOP)
        try:
            stalled_at = max(outer_by_step(folder_metrics(n0)))

            def alone() -> list[int]:
                rows = outer_by_step(folder_metrics(n0))
                return [k for k, r in rows.items() if k > stalled_at and r["nodes"] == 1]

            wait_until(lambda: alone() or nodes[0][0].poll() is not None, 120,
                       what="node 0 going on alone")  # fmt: skip
        finally:
            for p in nodes[1]:
                p.send_signal(signal.SIGCONT)
        went_alone = alone()

        def back() -> bool:
            rows = outer_by_step(folder_metrics(n0))
            again = [r for k, r in rows.items() if k > max(went_alone) and r["contributors"] == 2]
            return bool(again) or any(p.poll() is not None for p in everyone)

        wait_until(back, 300, what="node 1 contributing again")
        for ranks in nodes:  # each node stops at its next outer boundary
            for p in ranks:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in everyone]
    finally:
        coord.close()
    assert codes == [0] * 4, log_tails(tmp_path)
    assert went_alone, log_tails(tmp_path)
    log = (tmp_path / "node1.log").read_text()
    assert "lost the mesh membership" in log and "reentered the running job" in log, log[-3000:]
    rejoined = [r for r in folder_metrics(n1) if r.get("rejoined")]
    assert len(rejoined) == 1 and rejoined[0]["joined"], log_tails(tmp_path)
    mine, theirs = outer_by_step(folder_metrics(n1)), outer_by_step(folder_metrics(n0))
    after = [k for k in mine if k > max(went_alone) and k in theirs]
    assert after, log_tails(tmp_path)
    for k in after:  # every rank's shard, and the node's hash
        assert len(mine[k]["shard_sha256"]) == 2, mine[k]
        assert mine[k]["shard_sha256"] == theirs[k]["shard_sha256"], (k, log_tails(tmp_path))
        assert mine[k]["outer_sha256"] == theirs[k]["outer_sha256"], (k, log_tails(tmp_path))
    # it re-entered after the rounds it missed, not in their place, contributing nothing then
    entry = min(k for k, r in mine.items() if r["step"] >= rejoined[0]["step"])
    assert entry > max(went_alone), (entry, went_alone)
    assert theirs[entry]["nodes"] == 2 and theirs[entry]["contributors"] == 1, theirs[entry]


def _start_two_ranked_nodes(children, coord, token_cache, folders, args=()) -> list[list]:
    """Each folder's node of two ranks (`args` added to NODE's), started in turn (each
    registered before the next), so that the nodes' order in the run is the folders'."""
    nodes = []
    node = {**NODE, "args": [*NODE["args"], *args]}
    for k, folder in enumerate(folders):
        nodes.append(start_ranked_node(children, folder, 2, coordinator=coord.address,
                                       cache=token_cache, **node))  # fmt: skip
        wait_until(lambda n=k: len(coord.status()["nodes"]) > n, 120, what=f"node {k} registers")  # fmt: skip
    return nodes
