"""Nodes cannot silently disagree, and one node's bad numbers are not fatal, through the CLI.

Three prime-train nodes, each its own process and working folder, and a coordinator in the
test process. Each commit vote carries the node's outer step and outer weight hash, and the
coordinator compares them (prime-mesh's round_requests.py):

- a node whose outer weights were perturbed (a fault hook, after outer step PERTURB_AT) is
  told so at the next vote, logs one WARNING line with the step and both hashes, is evicted
  and rejoins through live recovery; the other two commit on, and every row after its
  rejoin carries the members' hash;
"""

import pytest

from prime_mesh import Coordinator
from prime_testkit import folder_metrics, log_tails, outer_by_step, start_cli_node, wait_until

TOKEN = "divergence-test-token"
H = 10
STEPS = 80
PERTURB_AT = 2  # node 2's weights differ from outer step 2 on: told at the vote on step 3
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": STEPS, "inner_steps": H}


def start_in_turn(children, folders, coord, cache, envs):
    """Each node in its folder once the coordinator lists the ones before it; `envs`: fault
    hooks by node index."""
    procs = []
    for k, folder in enumerate(folders):
        procs.append(start_cli_node(children, folder, coordinator=coord.address, cache=cache,
                                    env=envs.get(k, {}), **NODE))  # fmt: skip
        wait_until(lambda k=k: len(coord.status()["nodes"]) > k, 120, what=f"node {k} registers")
    return procs


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_whose_weights_differ_is_told_and_rejoins(tmp_path, token_cache, children):
    n = [tmp_path / f"node{k}" for k in range(3)]
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=3).start()
    try:
        env = {"PRIME_TRAIN_FAULT_PERTURB_OUTER_AT": str(PERTURB_AT)}
        procs = start_in_turn(children, n, coord, token_cache, {2: env})
        codes = [p.wait(timeout=300) for p in procs]
        events = coord.page_status()["events"]
    finally:
        coord.close()
    assert codes == [0, 0, 0], log_tails(tmp_path)

    evicted = [e for e in events if e["kind"] == "evicted"]
    assert [e["node_id"] for e in evicted] == ["node2"], events
    assert "outer weights differ from the other members'" in evicted[0]["reason"], evicted

    outer0, outer1 = outer_by_step(folder_metrics(n[0])), outer_by_step(folder_metrics(n[1]))
    assert outer0.keys() == outer1.keys() and max(outer0) == STEPS // H
    assert all(outer0[k]["outer_sha256"] == outer1[k]["outer_sha256"] for k in outer0)
    rows2 = folder_metrics(n[2])
    outer2 = outer_by_step(rows2)
    assert outer2[PERTURB_AT]["outer_sha256"] != outer0[PERTURB_AT]["outer_sha256"]
    assert outer0[PERTURB_AT + 1]["nodes"] == 2, "the others committed the next step without it"
    # the one WARNING line: the step and both hashes
    log = (tmp_path / "node2.log").read_text()
    warned = [line for line in log.splitlines() if "outer weights differ" in line]
    assert len(warned) == 1 and "] warning: " in warned[0], warned or log[-3000:]
    mine, theirs = outer2[PERTURB_AT]["outer_sha256"][:16], outer0[PERTURB_AT]["outer_sha256"][:16]
    assert f"outer step {PERTURB_AT} with hash {mine}" in warned[0], warned
    assert f"outer step {PERTURB_AT} with hash {theirs}" in warned[0], warned
    # it rejoined through live recovery within two rounds, then holds the members' weights
    rejoined = [r for r in rows2 if r.get("rejoined")]
    assert [r["rejoined"] for r in rejoined] == [1] and rejoined[0]["fetch_bytes"] > 0, rejoined
    back = min(k for k, r in outer2.items() if r["step"] >= rejoined[0]["step"])
    assert back <= PERTURB_AT + 3, (back, rejoined)
    for k in range(back, STEPS // H + 1):
        assert outer2[k]["outer_sha256"] == outer0[k]["outer_sha256"], k
    assert outer0[STEPS // H]["nodes"] == 3
