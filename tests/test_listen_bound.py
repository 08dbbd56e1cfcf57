"""Listening is bounded, through the CLI: a joiner whose snapshot cannot come in time (its
only donor serves at 0.2 Mbit/s: the 8.7 MB debug snapshot would take ~6 minutes) listens
to the member's rounds for at most `mesh.join_timeout_s`, then gives up with one line that
says why and exits 1; its kept rounds are deleted, and the member goes on undisturbed."""

import signal

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

TOKEN = "listen-bound-test-token"
BOUND_S = 15


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_listener_whose_snapshot_cannot_come_gives_up_at_the_join_timeout(
    tmp_path, token_cache, children
):
    n0, n1 = tmp_path / "node0", tmp_path / "node1"
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=1).start()
    node = {"coordinator": coord.address, "cache": token_cache, "host": "127.0.0.1",
            "token": TOKEN, "steps": 100_000, "inner_steps": 10}  # fmt: skip
    try:
        p0 = start_cli_node(children, n0, **node, args=["--mesh.serve_mbit", "0.2"])
        wait_until(lambda: 2 in outer_by_step(folder_metrics(n0)), 120,
                   what="node 0's outer step 2")  # fmt: skip
        p1 = start_cli_node(children, n1, **node,
                            args=["--mesh.join_timeout_s", str(BOUND_S)])  # fmt: skip
        code1 = wait_exit(p1, 150, tmp_path / "node1.log")
        steps_then = max(outer_by_step(folder_metrics(n0)))
        wait_until(lambda: max(outer_by_step(folder_metrics(n0))) >= steps_then + 2, 60,
                   what="node 0 going on without it")  # fmt: skip
        p0.send_signal(signal.SIGTERM)
        code0 = wait_exit(p0, 60, tmp_path / "node0.log")
    finally:
        coord.close()
    assert (code0, code1) == (0, 1), log_tails(tmp_path)
    log1 = (tmp_path / "node1.log").read_text()
    said = [line for line in log1.splitlines() if "past the mesh's join_timeout" in line]
    assert len(said) == 1 and f"join_timeout of {BOUND_S} s" in said[0], log1[-3000:]
    assert "rerun the same command to join again" in said[0], said
    assert not list(n1.rglob("listened-r*")), sorted(p.name for p in n1.rglob("*"))  # deleted
    assert not [r for r in folder_metrics(n1) if "outer_sha256" in r]  # it never entered
