"""A SIGTERM to one node mid-round (a spot machine's notice): it leaves at once, saves, exits 0,
and the same command rejoins later through live recovery; the other node never waits for a
heartbeat timeout. (Every node stopped together resumes exactly: test_diloco_train.py.) The
stopped node's `ckpt.remote` is an S3 endpoint that refuses connections, then, when the node
is stopped, accepts them and never answers: its final checkpoint reaches disk and the upload's
wait keeps to the stop bound (`train.stop_within_s` + 10 s); the endpoint refuses again when
the node is run again.

The coordinator is its own `prime-mesh coordinator` process; each node is its own `prime-train`
process in its own folder, as on its own machine.
"""

import json
import signal
from pathlib import Path

import pytest

from prime_testkit import (
    CREDENTIALS,
    DeadS3,
    folder_metrics,
    free_port,
    log_tails,
    outer_hashes,
    outer_rows,
    start_cli_node,
    start_coordinator_cli,
    wait_until,
)

TOKEN = "sigterm-test-token"
H = 40  # a round of several seconds here, far longer than stop_within_s below
STEPS = 320  # node a alone after b leaves: long enough for b, run again, to join it
# heartbeats that would take two minutes to notice a vanished node: the survivor must not wait
SLOW_HEARTBEATS = {"PRIME_MESH__HEARTBEAT_TIMEOUT_S": "120"}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sigterm_mid_round_leaves_at_once_and_the_same_command_rejoins(
    tmp_path, token_cache, children
):
    port = free_port()
    start_coordinator_cli(children, port, tmp_path / "coordinator.log", TOKEN)
    dead = DeadS3("refused")  # (a hung one would hold each start a listing's bound, 20 s)
    remote = ("--ckpt.remote", "s3://bucket/run",
              "--ckpt.remote_options", f'{{endpoint_url = "{dead.endpoint}"}}')  # fmt: skip

    def start(folder: Path, *more: str):
        return start_cli_node(
            children, folder, coordinator=f"127.0.0.1:{port}", host="127.0.0.1", token=TOKEN,
            cache=token_cache, steps=STEPS, inner_steps=H, env={**SLOW_HEARTBEATS, **CREDENTIALS},
            args=("--train.stop_within_s", "1", "--ckpt.every", "0", *more),
        )  # fmt: skip

    a, b = tmp_path / "a", tmp_path / "b"
    pa, pb = start(a), start(b, *remote)

    # mid-round: a few steps past the first boundary (a signal that lands while the boundary's
    # bookkeeping runs is a stop at that boundary, a different story)
    def into_round_two() -> bool:
        return any(r.get("step", 0) > H and "loss" in r for r in folder_metrics(b))

    wait_until(lambda: into_round_two() or pb.poll() is not None, 240,
               what="a step past the first outer step")  # fmt: skip
    assert pa.poll() is None and pb.poll() is None, log_tails(tmp_path)

    dead.hang()
    pb.send_signal(signal.SIGTERM)
    # within 30 s, cleanly: the hung upload is not waited for past stop_within_s + 10 s (its
    # own bound, ckpt.upload_timeout_s, is 60 s)
    assert pb.wait(timeout=30) == 0, log_tails(tmp_path)
    dead.close()
    left = b.with_suffix(".log").read_text()
    assert "SIGTERM received: left the mesh and checkpointed step 40" in left, left[-2000:]
    assert (b / "runs" / "debug" / "ckpt" / "step-0000000040" / "manifest.msgpack").is_file()
    # its only checkpoint's upload hung, so no try failed: given up at the way out, it is the
    # run's one checkpoint error, in the summary written after it
    summary = json.loads((b / "runs" / "debug" / "summary.json").read_text())
    assert summary["ckpt_errors"] == 1, summary
    assert "1 checkpoint errors" in left, left[-2000:]
    assert "left gracefully" in (tmp_path / "coordinator.log").read_text(), log_tails(tmp_path)

    # the survivor commits alone at its next boundary, long before a heartbeat timeout
    def alone() -> bool:
        return any(r["nodes"] == 1 for r in outer_rows(folder_metrics(a)))

    wait_until(lambda: alone() or pa.poll() is not None, 90, what="the survivor to go on alone")
    assert alone(), log_tails(tmp_path)

    pb = start(b, *remote)  # the same command: rejoins through live recovery
    assert pb.wait(timeout=300) == 0 and pa.wait(timeout=120) == 0, log_tails(tmp_path)
    joined = [r for r in folder_metrics(b) if r.get("joined")]
    assert joined and joined[0]["fetch_bytes"] > 0, log_tails(tmp_path)
    mine, theirs = outer_hashes(folder_metrics(b)), outer_hashes(folder_metrics(a))
    after = {k: v for k, v in mine.items() if k > 1}
    assert after, mine
    for k, digest in after.items():
        assert theirs[k] == digest, f"outer step {k} differs after the rejoin at {joined[0]}"


@pytest.mark.timeout(120)
def test_sigterm_while_a_node_waits_for_the_run_to_form_exits_0(tmp_path, token_cache, children):
    """A stop before the loop has nothing to save: a node SIGTERMed while it waits for the run
    to form (registered, before any group) exits 0, not by the signal, and the coordinator
    sees it go."""
    from prime_mesh import Coordinator
    from prime_testkit import node_states

    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        node = {"host": "127.0.0.1", "token": TOKEN, "steps": 20, "inner_steps": 10}
        p = start_cli_node(children, tmp_path / "n0", coordinator=coord.address,
                           cache=token_cache, **node)  # fmt: skip
        wait_until(lambda: node_states(coord) or p.poll() is not None, 90, what="registration")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0, log_tails(tmp_path)
        wait_until(lambda: not node_states(coord), 30, what="the coordinator to see it go")
    finally:
        coord.close()
