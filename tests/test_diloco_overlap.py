"""The overlapped outer step (`--diloco.overlap delayed`) across real node processes.

Nodes run the real CLI, each its own process and gloo world. The debug model's all-reduce
takes milliseconds, so the tests that need a round in flight hold it open with the fault hook
PRIME_TRAIN_FAULT_HOLD_ROUND_S (the background thread waits between its sync point and its
all-reduce), and act when a node's log says it is holding.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prime_mesh import Coordinator
from prime_testkit import (
    debug_args,
    node_metrics,
    outer_rows,
    run_local_nodes,
    start_local_nodes,
    trace,
    wait_until,
)

TOKEN = "diloco-overlap-test-token"
SHORT = [
    "--train.steps", "60",
    "--diloco.inner_steps", "20",
    "--diloco.overlap", "delayed",
    "--ckpt.every", "20",
    "--eval.every", "20",
    "--run.log_every", "10",
    "--launch.local_nodes", "2",
]  # fmt: skip


def holding(log: Path, step: int) -> bool:
    return log.is_file() and f"holding the outer round of step {step}" in log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_delayed_two_nodes_learn_with_identical_outer_weights(tmp_path, token_cache):
    runs = tmp_path / "runs"
    env = dict(os.environ, PRIME_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "prime_train.cli", *debug_args(runs, token_cache, *SHORT)],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = runs / "debug"
    rows = [outer_rows(node_metrics(run_dir, k)) for k in range(2)]
    # round k is applied at the end of round k+1; the last one at the last step
    for node_rows in rows:
        assert [(r["outer_step"], r["round_step"], r["step"]) for r in node_rows] == [
            (1, 20, 40), (2, 40, 60), (3, 60, 60)
        ]  # fmt: skip
        assert all(r["nodes"] == 2 for r in node_rows)
        assert all(0 <= r["compute_utilisation"] <= 1 for r in node_rows)
    assert [r["outer_sha256"] for r in rows[0]] == [r["outer_sha256"] for r in rows[1]]
    for name in ("summary.json", "summary-node1.json"):
        summary = json.loads((run_dir / name).read_text())
        assert summary["heldout_loss"] <= 0.7 * summary["initial_heldout_loss"]
        d = summary["diloco"]
        assert d["overlap"] == "delayed" and d["outer_steps"] == 3
        assert 0 < d["compute_utilisation"] <= 1
    # the final model is the outer weights: both nodes evaluate the same model at the end
    finals = [[r["eval_loss"] for r in node_metrics(run_dir, k) if r.get("step") == 60
               and "eval_loss" in r] for k in range(2)]  # fmt: skip
    assert finals[0] == finals[1] and len(finals[0]) == 1
    assert "compute utilisation" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_killed_during_a_background_round_is_dropped(tmp_path, token_cache, children):
    runs = tmp_path / "runs"
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        log0, log1 = tmp_path / "node-0.log", tmp_path / "node-1.log"
        n0, n1 = start_local_nodes(children, coord, token=TOKEN,
                                   args=debug_args(runs, token_cache, *SHORT), logs=[log0, log1],
                                   PRIME_TRAIN_FAULT_HOLD_ROUND_S="4")  # fmt: skip
        wait_until(lambda: holding(log1, 20) or n1.poll() is not None, 200,
                   what="node 1's first background round")  # fmt: skip
        assert n1.poll() is None, log1.read_text()[-3000:]
        n1.send_signal(signal.SIGKILL)
        assert n0.wait(timeout=200) == 0, log0.read_text()[-3000:]
    finally:
        coord.close()
    text = log0.read_text()
    assert "outer round of step 20 not committed" in text and "dropped on every node" in text
    assert "done: 60/60 steps" in text
    rows = outer_rows(node_metrics(runs / "debug", 0))
    assert [(r["round_step"], r["nodes"]) for r in rows] == [(40, 1), (60, 1)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_during_a_background_round_checkpoints_and_resumes_exactly(
    tmp_path, token_cache, children
):
    def run_delayed_pair(runs, stop_while_holding=None):
        """Both nodes in `runs` (logs {runs}-{k}.log); SIGTERM while the round of step
        `stop_while_holding` is held in flight, when given. Their exit codes."""
        hold = {"PRIME_TRAIN_FAULT_HOLD_ROUND_S": "3"} if stop_while_holding else {}
        prefix = runs.parent / runs.name

        def round_held() -> bool:
            """Both nodes hold the round and have passed the boundary's own stop check (its
            evaluation there follows the check): a SIGTERM now is one mid-round on each (a
            node still before that boundary, under load, would stop there instead)."""
            logs = [Path(f"{prefix}-{k}.log") for k in range(2)]
            return all(holding(log, stop_while_holding) and (
                f"step {stop_while_holding}/60 | held-out loss" in log.read_text()
            ) for log in logs)  # fmt: skip

        return run_local_nodes(children, token=TOKEN, args=debug_args(runs, token_cache, *SHORT),
                               logs=[Path(f"{prefix}-{k}.log") for k in range(2)],
                               stop_when=None if stop_while_holding is None else round_held,
                               what="a background round in flight", **hold)  # fmt: skip

    full, split = tmp_path / "full", tmp_path / "split"
    assert run_delayed_pair(full) == [0, 0]
    assert run_delayed_pair(split, stop_while_holding=20) == [0, 0]
    log = (tmp_path / "split-0.log").read_text()
    assert "SIGTERM received: stopped after step 40" in log, log[-3000:]
    assert run_delayed_pair(split) == [0, 0]
    assert "resumed from the step-40 checkpoint" in (tmp_path / "split-0.log").read_text()

    for node in range(2):
        a, b = (trace(node_metrics(runs / "debug", node), with_outer_step=True)
                for runs in (full, split))  # fmt: skip
        assert a == b, (
            f"node {node}: resumed run differs: {sorted(set(a.items()) ^ set(b.items()))[:6]}"
        )
    hashes = [[r["outer_sha256"] for r in outer_rows(node_metrics(split / "debug", k))]
              for k in range(2)]  # fmt: skip
    assert len(hashes[0]) == 3 and hashes[0] == hashes[1]
