"""Streaming outer steps (`[diloco] fragments = 3`) through the real CLI: two nodes, a 3-layer
debug model, one fragment synced every 5 inner steps. Every sync is an outer-step row naming
its fragment and bytes, with the same outer weights' hash on both nodes; both nodes told to
stop mid-round leave at once with the last committed sync (their local weights of the other
fragments included), and the resumed run reproduces the uninterrupted one exactly. With
`--diloco.overlap delayed` each fragment's sync is applied at the next sync point (its row one
sync later, the last two at the last step); told to stop mid-round, the nodes stop at the
round's end with that fragment's sync in flight, checkpoint it, and resume exactly too. (A node
joining a running job of two fragments: tests/test_join_replay.py's WAN-bed join.)"""

import pytest

from prime_testkit import (
    debug_args,
    log_tails,
    node_metrics,
    outer_hashes,
    run_local_nodes,
    trace,
)
from prime_testkit.runs import outer_rows

TOKEN = "fragments-cli-test-token"
ARGS = [
    "--model.n_layers", "3", "--diloco.fragments", "3", "--diloco.inner_steps", "15",
    "--train.steps", "20", "--eval.every", "15", "--run.log_every", "1", "--ckpt.every", "0",
    "--train.stop_within_s", "0", "--diloco.compression", "uint4",
    "--diloco.error_feedback", "true",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_three_fragments_sync_in_turn_and_resume_exactly(tmp_path, token_cache, children, overlap):
    go = tmp_path / "go"
    delayed = overlap == "delayed"

    def run_pair(runs, stop=False):
        def mid_round() -> bool:  # the sync of step 10 started, held before step 13
            # (both nodes: with overlap one can be at step 12 while the other is not at 10 yet,
            # and a signal there would stop that one at step 10)
            rows = [node_metrics(runs / "debug", k) for k in range(2)]
            if all((1 if delayed else 2) in outer_hashes(r) and any(x["step"] >= 12 for x in r)
                   for r in rows):  # fmt: skip
                go.touch()  # (the stop signal follows at once: it lands mid-round)
                return True
            return False

        # the split run's nodes wait before step 13 (at most 60 s) until the test lets them go
        hold = {"PRIME_TRAIN_FAULT_STALL_AT_STEP": "13", "PRIME_TRAIN_FAULT_STALL_S": "60",
                "PRIME_TRAIN_FAULT_STALL_UNTIL": str(go)} if stop else {}  # fmt: skip

        return run_local_nodes(children, token=TOKEN,
                               args=debug_args(runs, token_cache, *ARGS,
                                               "--diloco.overlap", overlap,
                                               "--launch.local_nodes", "2"),
                               logs=[runs.parent / f"{runs.name}-{k}.log" for k in range(2)],
                               stop_when=mid_round if stop else None,
                               what="step 12, after outer step 2", **hold)  # fmt: skip

    full, split = tmp_path / "full", tmp_path / "split"
    assert run_pair(full) == [0, 0], log_tails(tmp_path)
    rows = [outer_rows(node_metrics(full / "debug", k)) for k in range(2)]
    for k in range(2):  # a sync every 5 steps, fragments in turn, the same hash on both
        # (delayed: each applied at the next sync point, the last one by the last step)
        assert [r["step"] for r in rows[k]] == ([10, 15, 20, 20] if delayed else [5, 10, 15, 20])
        if delayed:
            assert [r["round_step"] for r in rows[k]] == [5, 10, 15, 20]
        assert [r["outer_step"] for r in rows[k]] == [1, 2, 3, 4]
        assert [r["fragment"] for r in rows[k]] == [0, 1, 2, 0]
        assert all(r["bytes_sent"] > 0 for r in rows[k])
    assert outer_hashes(rows[0]) == outer_hashes(rows[1])
    assert len(set(outer_hashes(rows[0]).values())) == 4
    # each sync sends one fragment: well under half of the three together
    per_cycle = sum(r["bytes_sent"] for r in rows[0][:3])
    assert max(r["bytes_sent"] for r in rows[0]) < 0.45 * per_cycle

    assert run_pair(split, stop=True) == [0, 0], log_tails(tmp_path)
    for k in range(2):
        log = (tmp_path / f"split-{k}.log").read_text()
        if delayed:  # at the round's end, with the sync of step 15 in flight
            assert "SIGTERM received: stopped after step 15" in log, log[-2000:]
        else:
            assert "left the mesh and checkpointed step 10" in log, log[-2000:]
    assert run_pair(split) == [0, 0], log_tails(tmp_path)
    for k in range(2):
        a, b = (trace(node_metrics(runs / "debug", k), with_outer_step=True)
                for runs in (full, split))  # fmt: skip
        assert a == b, (
            f"node {k}: resumed run differs: {sorted(set(a.items()) ^ set(b.items()))[:6]}"
        )
