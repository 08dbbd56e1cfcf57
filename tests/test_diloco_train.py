"""DiLoCo across real node processes: prime-train over prime-mesh, prime-comm and prime-ckpt.

Nodes run the real CLI (`python -m prime_train.cli`), each its own process and gloo world,
with a coordinator in the test process (or the CLI's own launcher).
"""

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
import torch

from prime_ckpt import fetch_from_peer
from prime_comm import ring_bytes
from prime_mesh import Coordinator
from prime_testkit import (
    debug_args,
    node_metrics,
    outer_hashes,
    run_local_nodes,
    start_local_node,
    trace,
    wait_until,
)
from prime_train.metrics import read_metrics
from prime_train.model import Transformer, model_args, num_params
from prime_train.plot import membership_changes

TOKEN = "diloco-train-test-token"
SHORT = [
    "--train.steps", "60",
    "--diloco.inner_steps", "20",
    "--ckpt.every", "20",
    "--eval.every", "20",
    "--run.log_every", "10",
]  # fmt: skip


def node0_url(coord) -> str:
    """Node 0 registered first (see the tests that start nodes), so it is the lowest node id."""
    nodes = sorted(coord.status()["nodes"], key=lambda n: int(n["node_id"].split("-")[1]))
    return nodes[0]["metadata"]["serve_url"]


@pytest.mark.timeout(300)
def test_two_nodes_through_the_cli_learn_with_identical_weights(tmp_path, token_cache):
    runs = tmp_path / "runs"
    env = dict(os.environ, PRIME_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "prime_train.cli",
         *debug_args(runs, token_cache, *SHORT, "--launch.local_nodes", "2")],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[node 0 rank 0]" in r.stdout and "[node 1 rank 0]" in r.stdout
    assert "DiLoCo: 3 outer steps" in r.stdout
    run_dir = runs / "debug"
    h0, h1 = outer_hashes(node_metrics(run_dir, 0)), outer_hashes(node_metrics(run_dir, 1))
    assert sorted(h0) == [1, 2, 3] and h0 == h1, "outer weights differ between nodes"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heldout_loss"] <= 0.7 * summary["initial_heldout_loss"]
    d = summary["diloco"]
    assert d["outer_steps"] == 3 and d["compression"] == "uint8"
    # uint8 sends at most 0.26x the bytes of the float32 ring all-reduce (the debug model has
    # 0.44M parameters per rank: each 64K block's codebook is a small share)
    with torch.device("meta"):
        numel = num_params(Transformer(model_args("debug")))
    assert numel >= 64 * 1024
    fp32_ring_bytes = ring_bytes(numel, world=2)
    sent = [r["bytes_sent"] for r in read_metrics(run_dir / "metrics.jsonl") if "bytes_sent" in r]
    assert len(sent) == 3 and sum(sent) == d["comm_bytes"]
    for b in sent:
        assert 0.2 * fp32_ring_bytes < b <= 0.26 * fp32_ring_bytes, (b, fp32_ring_bytes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_node_is_dropped_and_the_survivor_finishes(tmp_path, token_cache, children):
    runs = tmp_path / "runs"
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    page = coord.serve_status()
    try:
        args = debug_args(runs, token_cache, *SHORT, "--launch.local_nodes", "2")
        n0 = start_local_node(children, 0, coordinator=coord.address, token=TOKEN, args=args,
                              log=tmp_path / "node0.log")  # fmt: skip
        wait_until(lambda: len(coord.status()["nodes"]) == 1, 120, what="node 0 to register")
        n1 = start_local_node(children, 1, coordinator=coord.address, token=TOKEN, args=args,
                              log=tmp_path / "node1.log")  # fmt: skip
        run_dir = runs / "debug"
        wait_until(lambda: 1 in outer_hashes(node_metrics(run_dir, 1)) or n1.poll() is not None,
                   200, what="node 1's first outer step")  # fmt: skip
        assert n1.poll() is None, (tmp_path / "node1.log").read_text()[-3000:]
        # each node advertises its checkpoint server in the mesh: a joiner could fetch from it
        urls = {n["metadata"]["serve_url"] for n in coord.status()["nodes"]}
        assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
        wait_until(lambda: (run_dir / "ckpt-node1" / "step-0000000020").is_dir(), 60,
                   what="node 1's step-20 checkpoint")  # fmt: skip
        node1_url = next(u for u in urls if u != node0_url(coord))
        fetched = fetch_from_peer([node1_url], tmp_path / "joiner", token=TOKEN)
        assert fetched >= 20

        def node1_progress() -> dict:
            page_status = json.loads(
                urllib.request.urlopen(page.url + "api/status", timeout=10).read()
            )
            ids = {
                n["node_id"]
                for n in coord.status()["nodes"]
                if n["metadata"]["serve_url"] == node1_url
            }
            return next(
                (n.get("progress", {}) for n in page_status["nodes"] if n["node_id"] in ids), {}
            )

        # progress rides on the next heartbeat: let node 1's outer step reach the coordinator
        wait_until(lambda: node1_progress().get("outer_step", 0) >= 1, 30,
                   what="node 1's outer step on the status page")  # fmt: skip
        n1.send_signal(signal.SIGKILL)
        assert n0.wait(timeout=200) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        # the status page: the trainer's numbers, and the killed node evicted, with why
        status = json.loads(urllib.request.urlopen(page.url + "api/status", timeout=10).read())
    finally:
        coord.close()
    survivor, killed = (n["node_id"] for n in sorted(status["nodes"], key=lambda n: n["node_id"]))
    evicted = [e for e in status["events"] if e["kind"] == "evicted"]
    assert [(e["node_id"], e["reason"], e["members"]) for e in evicted] == [
        (killed, "connection of local rank 0 closed", [survivor])
    ]
    progress = {n["node_id"]: n["progress"] for n in status["nodes"]}
    assert progress[survivor]["step"] == 60 and progress[survivor]["outer_step"] == 3
    assert progress[killed]["outer_step"] >= 1 and progress[killed]["loss"] > 0
    # prime-train plot marks the outer step where the survivor went on alone
    r = subprocess.run([sys.executable, "-m", "prime_train.cli", "plot", str(runs / "debug")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and (runs / "debug" / "loss.png").stat().st_size > 10_000, r.stderr
    outer = [r for r in read_metrics(run_dir / "metrics.jsonl") if "outer_step" in r]
    assert [r["outer_step"] for r in outer] == [1, 2, 3]
    assert outer[0]["nodes"] == 2
    assert outer[-1]["nodes"] == 1, "the survivor still averaged with the dead node"
    alone = next(r for r in outer if r["nodes"] == 1)
    assert membership_changes(outer) == [(alone["step"], alone["epoch"], 1)]
    log = (tmp_path / "node0.log").read_text()
    assert "done: 60/60 steps" in log


# The round's end is too far: both leave at once and save the last outer step; with 2-bit
# error feedback, whose residual (each node's own, of that outer step) must be in that
# checkpoint too, else the resumed weight hashes differ.
LEAVE_AT_ONCE_EF = [
    "--train.stop_within_s", "0", "--ckpt.every", "0", "--diloco.inner_steps", "30",
    "--diloco.compression", "uint2", "--diloco.error_feedback", "true", "--run.log_every", "5",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "how",
    [
        # the round's end is near (a bound no round on a loaded machine outlasts): both stop
        # together at the next outer boundary
        ["--train.stop_within_s", "600", "--run.log_every", "5"],
        LEAVE_AT_ONCE_EF,
    ],
    ids=["at-the-boundary", "leave-at-once-error-feedback"],
)
def test_stopped_two_node_run_resumes_exactly(tmp_path, token_cache, children, how):
    def run_pair(runs, stop_after_outer=None):
        """Both nodes in `runs` (logs {runs}-{k}.log), registered in node order (so ranks, and
        float sums, match across runs); SIGTERM once outer step `stop_after_outer` is
        committed, when given. Their exit codes."""

        def outer_step_committed() -> bool:
            # signalled mid-round, in the round after that outer step (step 40 of 31..60 with
            # 30 inner steps, 25 of 21..40 with 20), on both nodes: a node still at the
            # boundary itself would stop there, while the other goes on to the next one
            mid = 40 if how == LEAVE_AT_ONCE_EF else 25
            rows = [node_metrics(runs / "debug", k) for k in range(2)]
            return stop_after_outer in outer_hashes(rows[0]) and all(
                any(r["step"] >= mid for r in node) for node in rows
            )

        args = debug_args(runs, token_cache, *SHORT, "--launch.local_nodes", "2", *how)
        return run_local_nodes(children, token=TOKEN, args=args,
                               logs=[runs.parent / f"{runs.name}-{k}.log" for k in range(2)],
                               stop_when=None if stop_after_outer is None else outer_step_committed,
                               what="the outer step to stop after")  # fmt: skip

    full, split = tmp_path / "full", tmp_path / "split"
    assert run_pair(full) == [0, 0]
    assert run_pair(split, stop_after_outer=1) == [0, 0]
    stopped_at = max(r["step"] for r in read_metrics(split / "debug" / "metrics.jsonl"))
    assert stopped_at < 60, "the run was not stopped early"
    if how == LEAVE_AT_ONCE_EF:  # each node left mid-round with the state of the last
        # outer step, its own included
        for k in range(2):
            log = (tmp_path / f"split-{k}.log").read_text()
            assert "left the mesh and checkpointed step 30" in log, log[-2000:]
    assert run_pair(split) == [0, 0]
    if "--diloco.error_feedback" in how:  # a residual was carried, the same in both runs
        rms = [r["ef_residual_rms"] for r in node_metrics(full / "debug", 0) if "outer_step" in r]
        assert len(rms) == 2 and min(rms) > 0

    for node in range(2):
        a, b = trace(node_metrics(full / "debug", node)), trace(node_metrics(split / "debug", node))
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        assert not differ, f"node {node}: the resumed run differs at (step, field) {differ[:8]}"
