"""A joiner whose checkpoint takes many rounds to arrive catches up by replaying the members'
committed updates and enters with their exact outer weights, without exiting (issue #24).

Through the CLI, each node its own process in its own folder; the members cap their serving
rate (`mesh.serve_mbit`) so low that the joiner's checkpoint takes many short rounds to come.
Synchronous: the donors serve at 4 Mbit/s; the joiner is admitted before its snapshot
arrives and listens (`diloco/listen.py`) for the rounds it takes, the members not waiting for
that transfer, then replays the kept rounds and enters with the members' outer hash.
"""

import signal
from pathlib import Path

import pytest

from prime_mesh import Coordinator
from prime_testkit import folder_metrics, log_tails, outer_by_step, start_cli_node, wait_until

TOKEN = "join-replay-test-token"
H = 10
STEPS = 5000  # never ends by itself, however fast the machine: the test stops the nodes
# 16 Mbit/s: the ~8.7 MB checkpoint takes ~4.4 s, several 10-step rounds on an idle machine
# (~1 s each); an update (~0.55 MB packed) ~0.15 s from the two donors together.
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": STEPS, "inner_steps": H,
        "args": ["--mesh.serve_mbit", "16"]}  # fmt: skip
# per overlap mode, the donors' cap: a delayed joiner replays the rounds it missed in place
# (the members wait for that transfer at their next sync point), so it needs entries that move
# faster than rounds; a synchronous one listens, and is tested where they move slower
SERVE_MBIT = {"none": "4", "delayed": "16"}
FAULTS = {
    # none: admitted before its snapshot came, it listens while it comes (several rounds at
    # the donors' 4 Mbit/s cap)
    "none": {},
    # it says ready() 8 s late the first time: the members commit meanwhile and it is admitted
    # late (then replays the rounds it missed in place, or leaves, replays and asks again)
    "delayed": {"PRIME_TRAIN_FAULT_JOIN_READY_DELAY_S": "8"},
}


def first_outer_matches(tmp_path: Path, joiner: Path, members: list[Path]) -> int:
    """The joiner's outer steps all have the members' hash; returns its first."""
    mine = outer_by_step(folder_metrics(joiner))
    assert mine, log_tails(tmp_path)
    for m in members:
        theirs = outer_by_step(folder_metrics(m))
        shared = [k for k in mine if k in theirs]  # (stopped by SIGTERM, one may go a step on)
        assert len(shared) >= 2, log_tails(tmp_path)
        for k in shared:
            assert mine[k]["outer_sha256"] == theirs[k]["outer_sha256"], (k, log_tails(tmp_path))
    return min(mine)


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_a_joiner_whose_fetch_outlasts_rounds_replays_them_and_enters(
    tmp_path, token_cache, children, overlap
):
    node = {**NODE, "args": ["--mesh.serve_mbit", SERVE_MBIT[overlap], "--diloco.overlap", overlap]}
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        nodes = []
        for k in range(2):
            nodes.append(start_cli_node(children, tmp_path / f"node{k}",
                                        coordinator=coord.address, cache=token_cache, **node))  # fmt: skip
            wait_until(
                lambda n=k: len(coord.status()["nodes"]) > n, 120, what=f"node {k} registers"
            )
        n0, n1, n2 = (tmp_path / f"node{k}" for k in range(3))
        wait_until(lambda: 2 in outer_by_step(folder_metrics(n0)) or nodes[0].poll() is not None,
                   240, what="the members' second outer step")  # fmt: skip
        assert nodes[0].poll() is None, log_tails(tmp_path)
        joiner = start_cli_node(children, n2, coordinator=coord.address, cache=token_cache,
                                env=FAULTS[overlap], **node)  # fmt: skip
        everyone = (*nodes, joiner)

        def joiner_contributed() -> bool:  # (delayed: it trains from its third round)
            rows = outer_by_step(folder_metrics(n0)).values()
            return any(r["contributors"] == 3 for r in rows) or any(
                p.poll() is not None for p in everyone
            )

        wait_until(joiner_contributed, 400, what="a round the joiner contributed to")
        for p in everyone:  # each stops at its next outer boundary
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in everyone]
    finally:
        coord.close()
    assert codes == [0, 0, 0], log_tails(tmp_path)
    joined = [r for r in folder_metrics(n2) if r.get("joined")]
    assert len(joined) == 1, log_tails(tmp_path)
    row = joined[0]
    assert row["fetch_bytes"] > 0, row
    if overlap == "delayed":  # the premise: the members committed rounds while it fetched
        assert row["replayed"] >= 1 and row["replay_bytes"] > 0 and row["replay_donors"], row
        assert row["late_admissions"] >= 1, row  # and it did not exit for it
    first = first_outer_matches(tmp_path, n2, [n0, n1])
    outer0 = outer_by_step(folder_metrics(n0))
    assert outer0[first]["nodes"] == 3 and outer0[first]["contributors"] == 2, outer0[first]
    assert any(r["contributors"] == 3 for k, r in outer0.items() if k > first), outer0
    log = (tmp_path / "node2.log").read_text()
    assert "replayed" in log and "entered the running job" in log and "timeline" in log
    if overlap == "none":
        # admitted before its snapshot came, it listened: a member contributing nothing, in
        # every round from its admission on (no round retried or re-formed for it), while the
        # snapshot came; rounds committed meanwhile: the members did not wait for it. Then
        # the backlog between the snapshot and its first kept round is none or one round.
        assert "admitted before its snapshot arrived" in log, log[-3000:]
        assert "caught up after listening" in log, log[-3000:]
        assert row["snapshot_rounds"] >= 2 and row["listened_fetching"] >= 1, row
        assert row["replayed"] <= 1 and row["late_admissions"] == 0, row
        listened = [outer0[k] for k in range(first - row["listened"] + 1, first + 1)]
        assert all(r["nodes"] == 3 and r["contributors"] == 2 and r["attempts"] == 1
                   for r in listened), listened  # fmt: skip
        assert len({r["epoch"] for r in listened}) == 1, listened
    else:
        # late: it replays in place, or (if that cannot be done) leaves, replays and asks
        # again; never exits for it (exit codes above)
        assert ("round(s) late: replayed outer steps" in log
                or "leaving, replaying the rounds since and asking again" in log), log[-3000:]  # fmt: skip
    steps = {k: r["step"] for k, r in outer_by_step(folder_metrics(n2)).items()}
    # (delayed: the joiner settles its entry round at once, the members a round later)
    assert all(steps[k] == outer0[k]["step"] for k in steps if k > first and k in outer0), (
        log_tails(tmp_path)
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nodes_arriving_as_the_run_ends_or_after_it_stop_with_exit_0(
    tmp_path, token_cache, children
):
    """A joiner still fetching when the members finish stops with a line saying so, and a node
    started after the run completed is told so by the coordinator: both exit 0."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    short = {**NODE, "steps": 60, "args": ["--mesh.serve_mbit", "0.5"]}  # ~2 min to fetch
    try:
        n0, late, after = tmp_path / "node0", tmp_path / "late", tmp_path / "after"
        member = start_cli_node(children, n0, coordinator=coord.address, cache=token_cache,
                                **short)  # fmt: skip
        wait_until(lambda: 1 in outer_by_step(folder_metrics(n0)) or member.poll() is not None,
                   240, what="the member's first outer step")  # fmt: skip
        joiner = start_cli_node(children, late, coordinator=coord.address, cache=token_cache,
                                **short)  # fmt: skip
        codes = [member.wait(timeout=200), joiner.wait(timeout=120)]
        again = start_cli_node(children, after, coordinator=coord.address, cache=token_cache,
                               **short)  # fmt: skip
        codes.append(again.wait(timeout=120))
    finally:
        coord.close()
    assert codes == [0, 0, 0], log_tails(tmp_path)
    assert "the run completed while this node waited to join" in (tmp_path / "late.log").read_text()
    assert "the run is complete" in (tmp_path / "after.log").read_text()
    assert not [r for r in folder_metrics(late) if "outer_step" in r]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_listening_joiner_stopped_by_sigterm_leaves_at_once(tmp_path, token_cache, children):
    """A joiner admitted before its snapshot came (it listens while the snapshot crawls at
    0.5 Mbit/s) and then sent SIGTERM leaves the mesh at once with a line and exit 0: it held
    nothing of its own to save. The member's rounds go on without it."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    slow = {**NODE, "args": ["--mesh.serve_mbit", "0.5"]}  # the snapshot takes minutes
    n0, joiner_dir = tmp_path / "node0", tmp_path / "joiner"
    try:
        member = start_cli_node(children, n0, coordinator=coord.address, cache=token_cache,
                                **slow)  # fmt: skip
        wait_until(lambda: 1 in outer_by_step(folder_metrics(n0)) or member.poll() is not None,
                   240, what="the member's first outer step")  # fmt: skip
        joiner = start_cli_node(children, joiner_dir, coordinator=coord.address,
                                cache=token_cache, **slow)  # fmt: skip

        def rounds_of(nodes: int) -> list[int]:
            return [k for k, r in outer_by_step(folder_metrics(n0)).items() if r["nodes"] == nodes]

        wait_until(lambda: rounds_of(2) or member.poll() is not None or joiner.poll() is not None,
                   180, what="a round with the listening joiner")  # fmt: skip
        assert member.poll() is None and joiner.poll() is None, log_tails(tmp_path)
        joiner.send_signal(signal.SIGTERM)
        code = joiner.wait(timeout=60)
        last = max(rounds_of(2))
        wait_until(lambda: [k for k in rounds_of(1) if k > last] or member.poll() is not None,
                   120, what="the member's rounds without the joiner")  # fmt: skip
        member.send_signal(signal.SIGTERM)
        codes = [code, member.wait(timeout=120)]
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    said = (tmp_path / "joiner.log").read_text()
    assert "SIGTERM received before training began" in said and "left the mesh" in said, said
    assert not [r for r in folder_metrics(joiner_dir) if "outer_step" in r]  # it never entered
