"""Time-budgeted rounds with a straggler, and their exact resume, through the CLI.

Three prime-train nodes, each its own process and working folder, and a coordinator in the
test process; node 2 trains at about a fifth of the others' speed (a fault hook). With
`diloco.round_seconds` every node ends its round when the round has lasted that long (at
most `inner_steps`), so the fast nodes keep most of their inner steps, the slow node still
contributes to most rounds with fewer, and the average weighs each by its tokens. The run is
stopped (SIGTERM) after a few rounds and resumed: the committed state comes back exactly (the
steps after it depend on the clock). No assertion is on wall time. The last test: a joiner
listening (`diloco/listen.py`) through time-budgeted rounds while its snapshot comes.
"""

import re
import signal
import statistics
import time

import pytest

from prime_mesh import Coordinator
from prime_testkit import (
    folder_metrics,
    log_tails,
    outer_by_step,
    start_cli_node,
    start_nodes_in_turn,
    stop_once_contributing,
    wait_until,
)

TOKEN = "stragglers-test-token"
H = 20
STEPS = 160  # 8 rounds of the run's position (H per committed round)
# a fast step takes ~0.1-0.4 s here (idle to loaded): a fast node runs all H steps in T, or
# at least H/2; the slow node (5x) stays below H even on an idle machine
ROUND_S = 5.0
STOP_AFTER = 3  # outer steps committed before the SIGTERM
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": STEPS, "inner_steps": H,
        "args": ["--diloco.round_seconds", str(ROUND_S), "--train.stop_within_s", "120",
                 "--ckpt.every", "0"]}  # fmt: skip
SLOW = {"PRIME_TRAIN_FAULT_SLOW_FACTOR": "5"}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_time_budgeted_rounds_with_a_straggler_resume_exactly(tmp_path, token_cache, children):
    n = [tmp_path / f"node{k}" for k in range(3)]
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=3).start()
    try:
        procs = start_nodes_in_turn(children, n, coord, {2: SLOW}, cache=token_cache, **NODE)
        wait_until(lambda: all(STOP_AFTER in outer_by_step(folder_metrics(f)) for f in n)
                   or any(p.poll() is not None for p in procs), 240,
                   what=f"outer step {STOP_AFTER}")  # fmt: skip
        # mid-round (a round lasts ROUND_S by the clock): a signal that lands on one node
        # while its boundary's bookkeeping runs stops it there, the others a round later
        time.sleep(ROUND_S / 2)
        for p in procs:  # all told at once: they stop together at the round's end
            p.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0], log_tails(tmp_path)
        stopped = [outer_by_step(folder_metrics(f)) for f in n]
        procs = start_nodes_in_turn(
            children, n, coord, {2: SLOW}, cache=token_cache, **NODE
        )  # the same commands: resume
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        coord.close()
    assert codes == [0, 0, 0], log_tails(tmp_path)

    # the stop: every node at the same committed outer step, the run not finished
    last = max(stopped[0])
    assert [max(s) for s in stopped] == [last] * 3 and STOP_AFTER <= last < STEPS // H
    # the resume restored each node's committed outer weights exactly
    want = stopped[0][last]["outer_sha256"]
    for k in range(3):
        log = (tmp_path / f"node{k}.log").read_text()
        loaded = re.findall(r"loaded outer step (\d+): outer_sha256 (\w+)", log)
        assert loaded == [(str(last), want)], (k, loaded, log[-2000:])

    rows = [folder_metrics(f) for f in n]
    outer = [outer_by_step(r) for r in rows]
    assert all(o.keys() == outer[0].keys() for o in outer)
    assert sorted(outer[0]) == list(range(1, STEPS // H + 1))  # H of position per round
    for s in outer[0]:
        # every node holds the same outer weights at every outer step
        assert len({o[s]["outer_sha256"] for o in outer}) == 1, s
        # the round's tokens are the contributors' tokens
        assert sum(o[s]["round_tokens"] for o in outer) == outer[0][s]["round_tokens_all"], s
        assert all(1 <= o[s]["round_inner_steps"] <= H for o in outer), s
        assert outer[0][s]["step"] == s * H

    steps = [[o[s]["round_inner_steps"] for s in sorted(o)] for o in outer]
    fast, slow = statistics.median(steps[0] + steps[1]), statistics.median(steps[2])
    # the fast nodes keep most of a round; the slow one runs fewer steps, not them
    assert fast >= H / 2, steps
    assert slow < fast, steps
    # the slow node still contributes to most rounds
    contributed = [s for s in outer[2] if outer[2][s]["round_tokens"] > 0]
    assert len(contributed) >= 0.75 * len(outer[2]), steps
    assert all(outer[2][s]["nodes"] == 3 for s in outer[2])  # never left out
    # the run learns
    losses = [r["loss"] for r in rows[0] if "tokens_per_s" in r and r.get("loss") is not None]
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_time_budgeted_rounds_overlap_delayed(tmp_path, token_cache, children):
    """With `overlap = "delayed"` a round is time-budgeted the same way: the slow node brings
    fewer steps, contributes, and every node applies the same weighted average (one round
    late, as delayed rounds are)."""
    n = [tmp_path / f"node{k}" for k in range(2)]
    node = dict(NODE, steps=100, args=[*NODE["args"], "--diloco.overlap", "delayed"])
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        procs = []
        for k, folder in enumerate(n):
            procs.append(start_cli_node(children, folder, coordinator=coord.address,
                                        cache=token_cache, env=SLOW if k else {}, **node))  # fmt: skip
            wait_until(lambda k=k: len(coord.status()["nodes"]) > k, 120, what=f"node {k}")
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    outer = [outer_by_step(folder_metrics(f)) for f in n]
    assert outer[0].keys() == outer[1].keys() and len(outer[0]) >= 4, outer[0].keys()
    for s in outer[0]:
        assert outer[0][s]["outer_sha256"] == outer[1][s]["outer_sha256"], s
        assert (
            outer[0][s]["round_tokens"] + outer[1][s]["round_tokens"]
            == (outer[0][s]["round_tokens_all"])
        ), s
    steps = [[o[s]["round_inner_steps"] for s in sorted(o)] for o in outer]
    assert statistics.median(steps[1]) < statistics.median(steps[0]), steps
    contributed = [s for s in outer[1] if outer[1][s]["round_tokens"] > 0]
    assert len(contributed) >= 0.75 * len(outer[1]), steps


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_time_budgeted_rounds_with_a_listening_joiner(tmp_path, token_cache, children):
    """Two nodes run time-budgeted rounds; a third joins mid-run while the members serve at
    3 Mbit/s each (its ~8.7 MB snapshot, from both at once, takes ~12 s: several rounds). It
    is admitted at once and listens (`diloco/listen.py`): a member contributing nothing to
    rounds that end by the clock, the members' weighted average counting its reads as none;
    then it enters with the members' outer hash, its rows at their steps, and every node
    exits 0 on SIGTERM. 42-45 s on 2 shared cores (load 3-5)."""
    n0, n1, n2 = (tmp_path / f"node{k}" for k in range(3))
    node = {"host": "127.0.0.1", "token": TOKEN, "steps": 5000, "inner_steps": H,
            "args": ["--diloco.round_seconds", "2", "--mesh.serve_mbit", "3"]}  # fmt: skip
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        members = []
        for k, folder in enumerate((n0, n1)):
            members.append(start_cli_node(children, folder, coordinator=coord.address,
                                          cache=token_cache, **node))  # fmt: skip
            wait_until(lambda k=k: len(coord.status()["nodes"]) > k, 120, what=f"node {k}")
        wait_until(lambda: 2 in outer_by_step(folder_metrics(n0))
                   or any(p.poll() is not None for p in members), 240,
                   what="the members' second outer step")  # fmt: skip
        assert all(p.poll() is None for p in members), log_tails(tmp_path)
        joiner = start_cli_node(children, n2, coordinator=coord.address, cache=token_cache,
                                **node)  # fmt: skip
        codes = stop_once_contributing(n0, [*members, joiner], contributors=3, timeout=240)
    finally:
        coord.close()
    assert codes == [0, 0, 0], log_tails(tmp_path)
    joined = [r for r in folder_metrics(n2) if r.get("joined")]
    assert len(joined) == 1 and joined[0]["listened"] >= 2, (joined, log_tails(tmp_path))
    assert joined[0]["late_admissions"] == 0, joined
    log = (n2.with_suffix(".log")).read_text()
    assert "admitted before its snapshot arrived" in log and "caught up after listening" in log
    outer = [outer_by_step(folder_metrics(f)) for f in (n0, n1, n2)]
    mine, first = outer[2], min(outer[2])
    for theirs in outer[:2]:  # its rows: the members' hash and step, at every outer step
        shared = [k for k in mine if k in theirs]  # (stopped by SIGTERM, one may go on)
        assert shared, log_tails(tmp_path)
        for k in shared:
            same = [mine[k][key] == theirs[k][key] for key in ("outer_sha256", "step")]
            assert all(same), (k, mine[k], theirs[k], log_tails(tmp_path))
    # the rounds it listened to: it in the group, contributing nothing, no tokens counted
    for k in range(first - joined[0]["listened"] + 1, first + 1):
        row = outer[0][k]
        assert row["nodes"] == 3 and row["contributors"] == 2, row
        assert row["round_tokens"] + outer[1][k]["round_tokens"] == row["round_tokens_all"], k
