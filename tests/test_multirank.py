"""Nodes of several ranks: DiLoCo over FSDP2 across local ranks, through the local launcher.

`[launch] local_nodes = 2, ranks_per_node = 2` starts two nodes of two rank processes each
(each node its own torch.distributed world, FSDP2 across its ranks; local rank r of every node
averages its shard in inter-node group r), as torchrun would on two machines.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prime_testkit import (
    TRACED,
    clean_env,
    debug_args,
    node_metrics,
    outer_by_step,
    trace,
    wait_exit,
    wait_until,
)
from prime_testkit.fixed_data import IndexDataset
from prime_train.slot_loader import SlotLoader

TOKEN = "multirank-test-token"
ARGS = [
    "--launch.local_nodes", "2",
    "--launch.ranks_per_node", "2",
    "--data.path", "{stdlib}/[a-c]*.py",
    "--data.seq_len", "64",
    "--train.batch_size", "4",
    "--train.steps", "60",
    "--diloco.inner_steps", "20",
    "--ckpt.every", "20",
    "--eval.every", "20",
    "--run.log_every", "5",
    # a SIGTERM stops every node at the round's end, however slow the machine: with the
    # default bound, a node whose estimate of the round's end passes it leaves at once while
    # the other stays, so their runs part from the uninterrupted one
    "--train.stop_within_s", "600",
]  # fmt: skip


def launch(children, runs: Path, cache: Path, log: Path):
    with open(log, "w") as out:
        return children.popen(
            [sys.executable, "-m", "prime_train.cli", *debug_args(runs, cache, *ARGS)],
            env=clean_env(PRIME_TOKEN=TOKEN), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def rank_pid(launcher_pid: int, node: int, rank: int) -> int | None:
    """The pid of the launcher's child process running node `node`, rank `rank`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            environ = dict(
                kv.split("=", 1)
                for kv in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in kv
            )
        except (OSError, ValueError):
            continue
        if environ.get("PRIME_LOCAL_NODE") == str(node) and environ.get("RANK") == str(rank):
            return int(entry.name)
    return None


def test_data_slots_of_a_run_never_overlap():
    """Each node reads its own data slots, its local ranks each their own share of them: over
    a whole run (before a slot wraps around) no two ranks of 2 nodes x 2 ranks see the same
    sequence."""
    n_seqs, batch, steps, slots = 10_000, 4, 600, 8

    seen: dict[int, tuple[str, int]] = {}
    for node in ("a", "b"):
        for rank in range(2):
            loader = SlotLoader(IndexDataset(n_seqs), batch, slots, node, rank, 2, seed=3)
            loader.reassign(["a", "b"])
            for _ in range(steps):
                inputs, _ = loader.next_batch()
                for i in inputs[:, 0].tolist():
                    assert i not in seen, f"sequence {i}: rank {(node, rank)} and {seen[i]}"
                    seen[i] = (node, rank)
            loader.end_round()
            assert max(loader.uncommitted()) <= n_seqs // slots, "a slot wrapped: fewer steps"
    assert len(seen) == 2 * 2 * steps * batch


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_of_two_ranks_learn_match_and_resume_exactly(tmp_path, children):
    cache = tmp_path / "cache"
    full, split = tmp_path / "full", tmp_path / "split"
    r = subprocess.run(
        [sys.executable, "-m", "prime_train.cli", *debug_args(full, cache, *ARGS)],
        env=clean_env(PRIME_TOKEN=TOKEN), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "starting 2 nodes of 2 ranks" in r.stdout and "FSDP2 over 2 rank(s)" in r.stdout
    run_dir = full / "debug"
    a, b = outer_by_step(node_metrics(run_dir, 0)), outer_by_step(node_metrics(run_dir, 1))
    assert sorted(a) == [1, 2, 3] and sorted(b) == [1, 2, 3]
    for k in a:  # every shard of the outer weights identical on both nodes
        assert len(a[k]["shard_sha256"]) == 2
        assert a[k]["shard_sha256"] == b[k]["shard_sha256"], f"outer step {k}"
        assert a[k]["outer_sha256"] == b[k]["outer_sha256"] and a[k]["nodes"] == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heldout_loss"] <= 0.7 * summary["initial_heldout_loss"], summary
    assert summary["tokens"] == 60 * 4 * 64 * 2  # per node: 2 ranks

    # SIGTERM to the launcher after the first outer step: every rank stops at an outer
    # boundary and checkpoints; the rerun resumes and reproduces the uninterrupted run
    log = tmp_path / "split.log"
    p = launch(children, split, cache, log)
    # mid-round 2 on both nodes (a node still at the boundary of round 1 would stop there
    # while the other goes on to the next one)
    wait_until(lambda: all(any(r["step"] >= 25 for r in node_metrics(split / "debug", k))
                           for k in range(2)) or p.poll() is not None,
               200, what="both nodes mid-round 2")  # fmt: skip
    p.send_signal(signal.SIGTERM)
    assert wait_exit(p, 200, log) == 0, log.read_text()[-3000:]
    assert "stopped after step" in log.read_text()
    r = subprocess.run(
        [sys.executable, "-m", "prime_train.cli", *debug_args(split, cache, *ARGS)],
        env=clean_env(PRIME_TOKEN=TOKEN), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from the step-" in r.stdout

    keep = (*TRACED, "shard_sha256")
    for node in range(2):
        assert trace(node_metrics(full / "debug", node), keep) == trace(
            node_metrics(split / "debug", node), keep
        ), f"node {node}: the resumed run differs"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_killed_rank_takes_its_node_out_and_the_other_node_finishes(tmp_path, children):
    runs, log = tmp_path / "runs", tmp_path / "launch.log"
    p = launch(children, runs, tmp_path / "cache", log)
    run_dir = runs / "debug"
    wait_until(lambda: 1 in outer_by_step(node_metrics(run_dir, 1)) or p.poll() is not None, 200,
               what="node 1's first outer step")  # fmt: skip
    pid = rank_pid(p.pid, node=1, rank=1)
    assert pid is not None, log.read_text()[-3000:]
    os.kill(pid, signal.SIGKILL)
    assert p.wait(timeout=300) == 1, log.read_text()[-3000:]  # node 1 failed: exit 1
    text = log.read_text()
    # its sibling either failed at once in an intra-node collective or was ended by the launcher
    assert "[launch] node 1 rank 1 exited with code -9" in text
    assert rank_pid(p.pid, node=1, rank=0) is None
    assert "[node 0 rank 0] done: 60/60 steps" in text
    outer = outer_by_step(node_metrics(run_dir, 0))
    assert sorted(outer) == [1, 2, 3] and outer[1]["nodes"] == 2
    assert outer[3]["nodes"] == 1, "node 0 still averaged with the dead node"
