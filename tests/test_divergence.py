"""Nodes cannot silently disagree, and one node's bad numbers are not fatal, through the CLI.

Three prime-train nodes, each its own process and working folder, and a coordinator in the
test process. Each commit vote carries the node's outer step and outer weight hash, and the
coordinator compares them (prime-mesh's round_requests.py):

- a node whose outer weights were perturbed (a fault hook, after outer step PERTURB_AT) is
  told so at the next vote, logs one WARNING line with the step and both hashes, is evicted
  and rejoins through live recovery (listening while the snapshot comes); the other two commit
  on, and every row after its rejoin carries the members' hash; it entered with a zero
  error-feedback residual and left no kept round behind;
- a node whose pseudo-gradient holds a NaN (a fault hook) is left out of that round (the
  other commits without it), says why, takes the committed weights and goes on.
"""

import pytest

from prime_mesh import Coordinator
from prime_testkit import folder_metrics, log_tails, outer_by_step, start_nodes_in_turn

TOKEN = "divergence-test-token"
H = 10
STEPS = 80
PERTURB_AT = 2  # node 2's weights differ from outer step 2 on: told at the vote on step 3
EF = ["--diloco.error_feedback", "true"]  # a joiner must enter with a zero residual
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": STEPS, "inner_steps": H}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_whose_weights_differ_is_told_and_rejoins(tmp_path, token_cache, children):
    n = [tmp_path / f"node{k}" for k in range(3)]
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=3).start()
    try:
        env = {"PRIME_TRAIN_FAULT_PERTURB_OUTER_AT": str(PERTURB_AT)}
        procs = start_nodes_in_turn(children, n, coord, {2: env}, cache=token_cache,
                                    **{**NODE, "args": EF})  # fmt: skip
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
    # it entered with a zero residual (the snapshot's is the donor's), its kept rounds gone
    assert outer2[back]["ef_residual_rms"] == 0.0, outer2[back]
    assert outer0[back]["ef_residual_rms"] > 0.0, outer0[back]
    assert not list((n[2] / "runs").glob("*/ckpt/listened-r*")), "kept rounds left behind"
    assert outer0[STEPS // H]["nodes"] == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_with_a_nan_or_an_outlying_norm_is_left_out_of_one_round(
    tmp_path, token_cache, children
):
    """Node 1's pseudo-gradient for outer step NAN_AT holds a NaN, node 0's for SCALE_AT is
    1000 times what it computed (fault hooks): each is left out of that round alone (the
    NaN by the node itself, the outlying norm by the sync point: above diloco.norm_bound x
    the other's), says why, and takes the committed weights; the run goes on."""
    n = [tmp_path / f"node{k}" for k in range(2)]
    nan_at, scale_at = 3, 4
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        envs = {0: {"PRIME_TRAIN_FAULT_SCALE_AT": str(scale_at)},
                1: {"PRIME_TRAIN_FAULT_NAN_AT": str(nan_at)}}  # fmt: skip
        procs = start_nodes_in_turn(children, n, coord, envs, cache=token_cache,
                                    **{**NODE, "steps": 50})  # fmt: skip
        codes = [p.wait(timeout=240) for p in procs]
        events = coord.page_status()["events"]
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    assert not [e for e in events if e["kind"] == "evicted"], events
    outer0, outer1 = outer_by_step(folder_metrics(n[0])), outer_by_step(folder_metrics(n[1]))
    assert outer0.keys() == outer1.keys() == set(range(1, 6)), log_tails(tmp_path)
    for k in outer0:  # the same weights everywhere, each node left out of one round only
        assert outer0[k]["outer_sha256"] == outer1[k]["outer_sha256"], k
        assert outer0[k]["contributors"] == (1 if k in (nan_at, scale_at) else 2), (k, outer0[k])
    for node, at, why in ((1, nan_at, "L2 norm is nan"), (0, scale_at, "diloco.norm_bound = 10")):
        log = (tmp_path / f"node{node}.log").read_text()
        warned = [line for line in log.splitlines() if "left out of the round" in line]
        assert len(warned) == 1 and f"outer step {at}: " in warned[0], warned or log[-3000:]
        assert why in warned[0], warned
