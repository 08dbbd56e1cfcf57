"""Losing the coordinator of a prime-train job: restarted in time, or gone past the grace.

The coordinator is its own `prime-mesh coordinator` process on a fixed port, SIGKILLed mid-run;
each node is its own `prime-train` process in its own folder, started with the same command.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prime_testkit import (
    check_same_outer,
    debug_args,
    folder_metrics,
    free_port,
    log_tails,
    node_metrics,
    outer_by_step,
    outer_rows,
    start_cli_node,
    start_coordinator_cli,
    stop_once_contributing,
    wait_until,
)
from prime_train.metrics import read_metrics

TOKEN = "coordinator-restart-test-token"
H = 10
STEPS = 100
FRAGMENTS = ("--diloco.fragments", "2")  # the debug model's 2 layers, one per fragment


def status(port: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "prime_mesh.cli", "status", "--coordinator", f"127.0.0.1:{port}"],
        env=dict(os.environ, PRIME_TOKEN=TOKEN), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return out.stdout + out.stderr


def node(
    children, folder: Path, port: int, cache: Path, grace: float, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    return start_cli_node(
        children, folder, coordinator=f"127.0.0.1:{port}",
        host="127.0.0.1", token=TOKEN, cache=cache, steps=STEPS, inner_steps=H,
        env={"PRIME_MESH__COORDINATOR_GRACE_S": str(grace)}, args=extra,
    )  # fmt: skip


def start_run(children, tmp_path, port, cache, grace, extra: tuple[str, ...] = ()):
    coord = start_coordinator_cli(children, port, tmp_path / "coordinator.log", TOKEN)
    folders = [tmp_path / f"node{k}" for k in range(2)]
    nodes = [node(children, f, port, cache, grace, extra) for f in folders]
    return coord, folders, nodes


def kill_after_outer_step(tmp_path, coord, folders, nodes, k: int) -> None:
    wait_until(lambda: len(outer_rows(folder_metrics(folders[0]))) >= k
               or any(p.poll() is not None for p in nodes),
               300, what=f"outer step {k}")  # fmt: skip
    assert all(p.poll() is None for p in nodes), log_tails(tmp_path)
    coord.send_signal(signal.SIGKILL)
    coord.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_coordinator_killed_and_restarted_mid_run(tmp_path, token_cache, children):
    port = free_port()
    coord, folders, nodes = start_run(children, tmp_path, port, token_cache, grace=120)
    kill_after_outer_step(tmp_path, coord, folders, nodes, 2)
    # the nodes go on with their inner steps and wait at the next outer step
    for f in folders:
        wait_until(lambda f=f: "coordinator_grace_s" in f.with_suffix(".log").read_text(), 120,
                   what=f"{f.name} waiting for the coordinator")  # fmt: skip
    assert all(p.poll() is None for p in nodes), log_tails(tmp_path)
    coord = start_coordinator_cli(
        children, port, tmp_path / "coordinator.log", TOKEN
    )  # the same again
    wait_until(lambda: "epoch 2, 2 members" in status(port), 120, what="the run re-formed")
    codes = [p.wait(timeout=400) for p in nodes]
    coord.send_signal(signal.SIGTERM)
    coord.wait(timeout=30)
    assert codes == [0, 0], log_tails(tmp_path)
    per_node = [outer_rows(folder_metrics(f)) for f in folders]
    for rows in per_node:  # no committed outer step rolled back, none skipped
        assert [r["outer_step"] for r in rows] == list(range(1, STEPS // H + 1)), rows
        assert rows[-1]["epoch"] == 2 and rows[-1]["nodes"] == 2, rows[-1]
    for a, b in zip(*per_node, strict=True):
        assert a["outer_sha256"] == b["outer_sha256"], (a, b)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["fragments", "delayed"])
def test_coordinator_gone_past_the_grace_checkpoints_and_the_rerun_resumes(
    tmp_path, token_cache, children, mode
):
    # fragments: synchronous, the model synced in two fragments in turn (a sync every H/2
    # steps, each its own outer step); delayed: the round in flight when the coordinator died
    # ends in CoordinatorGone at the next boundary (or at a checkpoint, which waits for it)
    # and is dropped
    extra = FRAGMENTS if mode == "fragments" else ("--diloco.overlap", "delayed")
    port = free_port()
    coord, folders, nodes = start_run(children, tmp_path, port, token_cache, grace=3, extra=extra)
    kill_after_outer_step(tmp_path, coord, folders, nodes, 2)
    codes = [p.wait(timeout=300) for p in nodes]
    assert codes == [1, 1], log_tails(tmp_path)
    steps = set()
    for f in folders:
        lines = [ln for ln in f.with_suffix(".log").read_text().splitlines()
                 if ln.startswith("prime-train: CoordinatorGone:")]  # fmt: skip
        assert len(lines) == 1 and "rerun the same command" in lines[0], log_tails(tmp_path)
        steps.add(int(re.search(r"checkpointed step (\d+)", lines[0]).group(1)))
    (step,) = steps  # every node stopped at the same committed outer step
    period = H // 2 if mode == "fragments" else H  # (a fragment's sync point is a boundary)
    assert step % period == 0 and step >= 2 * period
    committed = {
        r["outer_step"]: r["outer_sha256"]
        for r in outer_rows(folder_metrics(folders[0]))
        if r["step"] <= step
    }

    coord = start_coordinator_cli(children, port, tmp_path / "coordinator.log", TOKEN)
    nodes = [node(children, f, port, token_cache, grace=3, extra=extra) for f in folders]
    codes = [p.wait(timeout=400) for p in nodes]
    coord.send_signal(signal.SIGTERM)
    coord.wait(timeout=30)
    assert codes == [0, 0], log_tails(tmp_path)
    for f in folders:
        assert f"resumed from the step-{step} checkpoint" in f.with_suffix(".log").read_text()
    final = [
        {r["outer_step"]: r["outer_sha256"] for r in outer_rows(folder_metrics(f))} for f in folders
    ]
    # delayed: the dropped round, and the first boundary after the resume, apply nothing
    last = STEPS // H * 2 if mode == "fragments" else max(final[0])
    assert final[0] == final[1] and set(final[0]) == set(range(1, last + 1))
    assert last > max(committed), "the rerun committed outer steps of its own"
    for k, digest in committed.items():  # the committed steps were kept, not redone
        assert final[0][k] == digest


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_launcher_restarts_a_killed_coordinator(tmp_path, token_cache, children):
    # two ranks per node: each rank reconnects on its own; the node counts once all are back
    runs = tmp_path / "runs"
    env = dict(os.environ, PRIME_TOKEN=TOKEN, OMP_NUM_THREADS="1",
               PRIME_MESH__HEARTBEAT_INTERVAL_S="0.5", PRIME_MESH__HEARTBEAT_TIMEOUT_S="3")  # fmt: skip
    env.pop("PRIME_LOCAL_NODE", None)
    log = tmp_path / "launcher.log"
    with open(log, "w") as out:
        launcher = children.popen(
            [sys.executable, "-m", "prime_train.cli", *debug_args(runs, token_cache),
             "--train.steps", str(STEPS), "--diloco.inner_steps", str(H), "--eval.every", "0",
             "--launch.local_nodes", "2", "--launch.ranks_per_node", "2"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    metrics = runs / "debug" / "metrics.jsonl"
    wait_until(lambda: (metrics.exists() and any("outer_step" in r for r in read_metrics(metrics)))
               or launcher.poll() is not None, 300, what="the first outer step")  # fmt: skip
    assert launcher.poll() is None, log.read_text()[-3000:]
    coordinators = [p for p in child_pids(launcher.pid)
                    if b"prime_mesh.cli" in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
    assert len(coordinators) == 1, coordinators
    os.kill(coordinators[0], signal.SIGKILL)
    assert launcher.wait(timeout=400) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "[launch] the coordinator exited" in text, text[-3000:]
    outer = [outer_by_step(node_metrics(runs / "debug", k)) for k in range(2)]
    assert sorted(outer[0]) == sorted(outer[1]) == list(range(1, STEPS // H + 1))
    for k, r in outer[0].items():
        assert r["outer_sha256"] == outer[1][k]["outer_sha256"], k
    assert outer[0][STEPS // H]["epoch"] == 2, "re-formed once, by the restarted coordinator"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_coordinator_restarted_while_a_joiner_listens(tmp_path, token_cache, children):
    """A joiner admitted before its snapshot came listens while the snapshot crawls (its one
    member serves at 3 Mbit/s: ~8.7 MB in ~25 s); the coordinator is SIGKILLed and restarted
    on the same port meanwhile. The restarted coordinator re-forms the run from the nodes at
    the newest outer step: the listener, holding no state of its own yet, is sent away. It
    registers again by itself and listens again (a new snapshot in the background), then
    enters with the member's outer weights: its outer hash equals the member's at every
    outer step it took. 55 s on 2 shared cores."""
    port = free_port()
    coord = start_coordinator_cli(children, port, tmp_path / "coordinator.log", TOKEN, 1)
    member_dir, joiner_dir = tmp_path / "node0", tmp_path / "joiner"
    slow = ("--mesh.serve_mbit", "3")
    endless = {"coordinator": f"127.0.0.1:{port}", "host": "127.0.0.1", "token": TOKEN,
               "cache": token_cache, "steps": 5000, "inner_steps": H, "args": slow}  # fmt: skip
    member = start_cli_node(children, member_dir, **endless)
    wait_until(lambda: 1 in outer_by_step(folder_metrics(member_dir)) or member.poll() is not None,
               240, what="the member's first outer step")  # fmt: skip
    joiner = start_cli_node(children, joiner_dir, **endless)
    procs = (member, joiner)

    def listened() -> bool:  # a round committed with the joiner in, before its snapshot came
        rows = outer_by_step(folder_metrics(member_dir)).values()
        return any(r["nodes"] == 2 for r in rows) or any(p.poll() is not None for p in procs)

    wait_until(listened, 180, what="a round with the listening joiner")
    assert all(p.poll() is None for p in procs), log_tails(tmp_path)
    assert not [r for r in folder_metrics(joiner_dir) if r.get("joined")], "snapshot too fast"
    codes = _restart_coordinator_until_the_joiner_contributes(children, coord, port, tmp_path,
                                                              joiner_dir, procs)  # fmt: skip
    assert codes == [0, 0], log_tails(tmp_path)
    joined = [r for r in folder_metrics(joiner_dir) if r.get("joined")]
    assert len(joined) == 1 and joined[0]["listened"] >= 1, (joined, log_tails(tmp_path))
    assert joined[0]["late_admissions"] == 1, joined  # sent away once, by the restart
    assert "lost its place while joining" in (tmp_path / "joiner.log").read_text()
    _assert_the_members_hashes(joiner_dir, member_dir)


def _restart_coordinator_until_the_joiner_contributes(
    children, coord, port: int, tmp_path: Path, joiner_dir: Path, procs
) -> list[int]:
    """SIGKILL the coordinator and restart it on the same port; once the joiner contributed
    to a round, SIGTERM the nodes (each stops at its next outer boundary), then the
    coordinator. The nodes' exit codes."""
    coord.send_signal(signal.SIGKILL)
    coord.wait(timeout=30)
    coord = start_coordinator_cli(children, port, tmp_path / "coordinator.log", TOKEN, 1)
    codes = stop_once_contributing(joiner_dir, procs, 2, timeout=240)
    coord.send_signal(signal.SIGTERM)
    coord.wait(timeout=30)
    return codes


def _assert_the_members_hashes(joiner_dir: Path, member_dir: Path) -> None:
    """The joiner's outer hash equals the member's at every outer step both took, and the
    restarted coordinator re-formed the run."""
    check_same_outer(joiner_dir, [member_dir])
    theirs = outer_by_step(folder_metrics(member_dir))
    assert max(r["epoch"] for r in theirs.values()) >= 2, "re-formed by the restarted coordinator"
