"""A joiner whose checkpoint takes many rounds to arrive catches up by replaying the members'
committed updates and enters with their exact outer weights, without exiting (issue #24).

Through the CLI, each node its own process in its own folder, on the WAN bed (network
namespaces, every link 8 Mbit/s, the donors serving at half of it): synchronous, with 2
streaming fragments (each round one fragment's) synced with `overlap = "delayed"`, and with
`overlap = "delayed"` alone, the joiner is
admitted before its snapshot arrives and listens (`diloco/listen.py`) for the many rounds it
takes, the members not waiting for that transfer, then replays the kept rounds and enters
with the members' outer hash.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prime_netbed import WanBed, bed_unavailable_reason

from prime_mesh import Coordinator
from prime_testkit import (
    check_same_outer,
    folder_metrics,
    log_tails,
    outer_by_step,
    start_cli_node,
    stop_once_contributing,
    wait_until,
)

TOKEN = "join-replay-test-token"
H = 10
STEPS = 5000  # never ends by itself, however fast the machine: the test stops the nodes
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": STEPS, "inner_steps": H}
# The bed: 8 Mbit/s links, the donors at 4: the ~8.7 MB checkpoint takes ~18 s, many 10-step
# rounds (~1-2 s each); an update (~0.55 MB packed) well under a round.
BED_MBIT = 8.0
BED_PORT = 29500  # inside the bed's own namespace: nothing else listens there
COORD = 3  # the bed's last namespace holds the coordinator
# heartbeats share the slow links with the snapshot and the all-reduce: a 3 s timeout is tight
BED_HEARTBEATS = {"PRIME_MESH__HEARTBEAT_TIMEOUT_S": "10"}


def check_the_join(tmp_path: Path) -> dict:
    """What every join must show: one join, entered with the members' hashes at every outer
    step, at the members' step; returns the joiner's `joined` row."""
    n0, n1, n2 = (tmp_path / f"node{k}" for k in range(3))
    joined = [r for r in folder_metrics(n2) if r.get("joined")]
    assert len(joined) == 1, log_tails(tmp_path)
    row = joined[0]
    assert row["fetch_bytes"] > 0, row
    first = min(check_same_outer(n2, [n0, n1], at_least=2))  # its outer steps: the members'

    outer0 = outer_by_step(folder_metrics(n0))
    assert outer0[first]["nodes"] == 3 and outer0[first]["contributors"] == 2, outer0[first]
    assert any(r["contributors"] == 3 for k, r in outer0.items() if k > first), outer0
    log = (tmp_path / "node2.log").read_text()
    assert "replayed" in log and "entered the running job" in log and "timeline" in log
    # admitted before its snapshot came, it listened: a member contributing nothing, in every
    # round from its admission on (no round retried or re-formed for it), while the snapshot
    # came; rounds committed meanwhile: the members did not wait for it. Then the backlog
    # between the snapshot and its first kept round is none or one round.
    assert "admitted before its snapshot arrived" in log, log[-3000:]
    assert "caught up after listening" in log, log[-3000:]
    assert row["snapshot_rounds"] >= 3 and row["listened_fetching"] >= 2, row
    assert row["replayed"] <= 1 and row["late_admissions"] == 0, row
    listened = [outer0[k] for k in range(first - row["listened"] + 1, first + 1)]
    assert all(r["nodes"] == 3 and r["contributors"] == 2 and r["attempts"] == 1
               for r in listened), listened  # fmt: skip
    assert len({r["epoch"] for r in listened}) == 1, listened
    steps = {k: r["step"] for k, r in outer_by_step(folder_metrics(n2)).items()}
    # (delayed: the joiner settles its entry round at once, the members a round later)
    assert all(steps[k] == outer0[k]["step"] for k in steps if k > first and k in outer0), (
        log_tails(tmp_path)
    )
    return row


@pytest.mark.slow
@pytest.mark.wan
@pytest.mark.skipif(bed_unavailable_reason() is not None, reason=str(bed_unavailable_reason()))
@pytest.mark.timeout(500)
# (the synchronous listening join on a slow link: every seed of tests/test_churn.py's, whose
# nodes run again and join on 8 Mbit/s links)
def test_a_joiner_on_a_slow_link_listens_through_its_fetch_and_enters(
    tmp_path, token_cache, children
):
    """On the WAN bed: every node's link at BED_MBIT, the donors serving at half of it (the
    setting's advice); the joiner's ~8.7 MB snapshot takes several short rounds to cross its
    link, beside the rounds' all-reduce on the same link. It is admitted before its snapshot
    arrives, listens, replays the kept rounds and enters with the members' hash. With 2
    streaming fragments (a sync every H / 2 steps, each one fragment's) and `overlap =
    "delayed"` (the members' all-reduce runs behind their inner steps, so its snapshot may hold
    a fragment's sync in flight), it listens to the fragment the members sync and enters at
    the fragment of the committed count. (One fragment, delayed, walks the same path with
    fewer cases; the synchronous join with fragments: test_cut_link's rejoin.)"""
    n0, n1, n2 = (tmp_path / f"node{k}" for k in range(3))
    coord_log = tmp_path / "coordinator.log"
    node = {k: v for k, v in NODE.items() if k != "host"}
    fragments = 2
    node = {**node, "args": ["--mesh.serve_mbit", str(BED_MBIT / 2),
                             "--diloco.fragments", str(fragments),
                             "--diloco.overlap", "delayed"],
            "env": {"GLOO_SOCKET_IFNAME": "eth0", **BED_HEARTBEATS}}  # fmt: skip
    with WanBed(4, rate_mbit=BED_MBIT) as bed:  # (closing it kills what is left inside)
        with open(coord_log, "w") as out:
            coord = children.popen(
                bed.exec_prefix(COORD)
                + [sys.executable, "-m", "prime_mesh.cli", "coordinator", "--host",
                   bed.ip(COORD), "--port", str(BED_PORT), "--min-nodes", "2"],
                env=dict(os.environ, PRIME_TOKEN=TOKEN), stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        address = f"{bed.ip(COORD)}:{BED_PORT}"

        def start(k: int, folder: Path) -> subprocess.Popen:
            p = start_cli_node(children, folder, prefix=bed.exec_prefix(k), host=bed.ip(k),
                               coordinator=address, cache=token_cache, **node)  # fmt: skip
            said = f"{folder.name} local rank 0/1 registered"
            wait_until(lambda: said in coord_log.read_text() or p.poll() is not None, 120,
                       what=f"{folder.name} registers")  # fmt: skip
            return p

        members = [start(0, n0), start(1, n1)]
        wait_until(lambda: 2 in outer_by_step(folder_metrics(n0)) or members[0].poll() is not None,
                   240, what="the members' second outer step")  # fmt: skip
        assert members[0].poll() is None, log_tails(tmp_path)
        codes = stop_once_contributing(n0, [*members, start(2, n2)], contributors=3)
        coord.send_signal(signal.SIGTERM)
        codes.append(coord.wait(timeout=30))
    assert codes == [0, 0, 0, 0], log_tails(tmp_path)
    row = check_the_join(tmp_path)
    assert row["listened"] >= 3, row  # (the members never waited: check_the_join's rounds)
    log = (tmp_path / "node2.log").read_text()
    assert "round(s) late: replayed outer steps" not in log, log[-3000:]  # not in place
    for folder in (n0, n1, n2):  # every sync one fragment's, by the committed count
        rows = outer_by_step(folder_metrics(folder))
        assert all(r["fragment"] == (k - 1) % fragments for k, r in rows.items()), rows
        # (delayed: the sync of its round applied, and its row written, a sync later)
        assert all(r.get("round_step", r["step"]) % (H // fragments) == 0
                   for r in rows.values()), rows  # fmt: skip


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_listener_whose_all_reduce_failed_in_a_committed_round_catches_up_again(
    tmp_path, token_cache, children
):
    """The members do not wait for a listener's ballot (prime-mesh). A listener whose own
    all-reduce failed in a round they committed (a fault hook: its second listened round
    fails on it alone, and its ballot goes out 1 s late) is told the round committed: it does
    not hold that round's update, so it leaves, catches up again and enters with the member's
    hash. The member never retried a round for it."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    slow = {**NODE, "args": ["--mesh.serve_mbit", "3"]}  # the snapshot takes several rounds
    n0, joiner_dir = tmp_path / "node0", tmp_path / "joiner"
    fails = {"PRIME_TRAIN_FAULT_LISTENER_ROUND_FAILS": "2"}
    try:
        member = start_cli_node(children, n0, coordinator=coord.address, cache=token_cache,
                                **slow)  # fmt: skip
        wait_until(lambda: 1 in outer_by_step(folder_metrics(n0)) or member.poll() is not None,
                   240, what="the member's first outer step")  # fmt: skip
        joiner = start_cli_node(children, joiner_dir, coordinator=coord.address,
                                cache=token_cache, env=fails, **slow)  # fmt: skip
        codes = stop_once_contributing(joiner_dir, [member, joiner], 2)
    finally:
        coord.close()
    assert codes == [0, 0], log_tails(tmp_path)
    said = (tmp_path / "joiner.log").read_text()
    assert "round 2 fails here" in said, log_tails(tmp_path)
    assert "its all-reduce failed while the members committed" in said, log_tails(tmp_path)
    joined = [r for r in folder_metrics(joiner_dir) if r.get("joined")]
    assert len(joined) == 1 and joined[0]["late_admissions"] >= 1, joined
    mine, theirs = outer_by_step(folder_metrics(joiner_dir)), outer_by_step(folder_metrics(n0))
    assert all(r["attempts"] == 1 for r in theirs.values()), "the member never waited or retried"
    shared = [k for k in mine if k in theirs]
    assert shared, log_tails(tmp_path)
    for k in shared:
        assert mine[k]["outer_sha256"] == theirs[k]["outer_sha256"], (k, log_tails(tmp_path))
