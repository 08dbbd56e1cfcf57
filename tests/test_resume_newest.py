"""A run that lost every member re-forms from the newest state any founding node holds
(issue #33): two nodes run and checkpoint, both are stopped, one node's checkpoint folder is
cut back to an older step, and the same commands start them again together. The node that
holds the newest step founds the run from it (a resume); the other, behind, joins it through
the one join path (snapshot from the member, replay), and from its first contribution both
nodes hold the same outer weights at every outer step. Every process exits 0.

Each node runs the real CLI in its own folder; the coordinator is its own `prime-mesh
coordinator` process (a new one for the second start, as after losing every member).
"""

import shutil
import signal
from pathlib import Path

import pytest

from prime_testkit import (
    folder_metrics,
    free_port,
    log_tails,
    outer_by_step,
    start_cli_node,
    start_coordinator_cli,
    wait_until,
)

ROUNDS_TOGETHER = 3  # rounds both nodes contribute to after the join, before the stop

TOKEN = "resume-newest-test-token"
H = 10
STEPS = 5000  # never reached: the test stops the nodes (SIGTERM), however fast the machine
ARGS = ("--data.seq_len", "64", "--train.batch_size", "4",
        "--ckpt.every", "10", "--ckpt.keep", "3")  # fmt: skip


def start(children, tmp_path: Path, cache: Path, phase: str):
    """A coordinator for two nodes and both nodes, started together; node k in
    `tmp_path/node{k}` (its RAM tier in `node{k}/shm`)."""
    port = free_port()
    coord = start_coordinator_cli(children, port, tmp_path / f"coordinator-{phase}.log", TOKEN)
    folders = [tmp_path / f"node{k}" for k in range(2)]
    nodes = []
    for f in folders:
        nodes.append(start_cli_node(children, f, coordinator=f"127.0.0.1:{port}",
                                    host="127.0.0.1", token=TOKEN, cache=cache, steps=STEPS,
                                    inner_steps=H,
                                    args=(*ARGS, "--ckpt.shm_dir", str(f / "shm"))))  # fmt: skip
    return coord, folders, nodes


def steps_held(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (folder / "runs/debug/ckpt").glob("step-*"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_founders_resume_from_the_newest_step_and_a_node_behind_joins(
    tmp_path, token_cache, children
):
    coord, folders, nodes = start(children, tmp_path, token_cache, "first")
    # both nodes stop at the boundary after outer step 2 (SIGTERM: checkpoint, exit 0)
    wait_until(lambda: 2 in outer_by_step(folder_metrics(folders[0]))
               or any(p.poll() is not None for p in nodes), 200, what="outer step 2")  # fmt: skip
    for p in nodes:
        p.send_signal(signal.SIGTERM)
    assert [p.wait(timeout=120) for p in nodes] == [0, 0], log_tails(tmp_path)
    coord.send_signal(signal.SIGTERM)
    coord.wait(timeout=30)
    held = steps_held(folders[0])
    assert held == steps_held(folders[1]) and len(held) == 3, held
    newest, older = held[-1], held[:-1]

    # node 1 lost its newest checkpoint (and its RAM tier): it holds only older steps, one
    # of them common to both nodes; the newest wins, so no round is thrown away
    shutil.rmtree(folders[1] / "runs/debug/ckpt" / f"step-{newest:010d}")
    shutil.rmtree(folders[1] / "shm", ignore_errors=True)
    assert steps_held(folders[1]) == older
    for f in folders:
        f.with_suffix(".log").rename(f.with_suffix(".first.log"))

    coord, folders, nodes = start(children, tmp_path, token_cache, "second")

    def together() -> int:  # node 0's rounds since the joiner contributes
        return sum(r["contributors"] == 2 for r in outer_by_step(folder_metrics(folders[0])).values()
                   if r["step"] > newest)  # fmt: skip

    wait_until(lambda: together() >= ROUNDS_TOGETHER or any(p.poll() is not None for p in nodes),
               240, what=f"{ROUNDS_TOGETHER} rounds of both nodes")  # fmt: skip
    for p in nodes:
        p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=120) for p in nodes]
    coord.send_signal(signal.SIGTERM)
    assert codes == [0, 0], log_tails(tmp_path)
    logs = [f.with_suffix(".log").read_text() for f in folders]
    assert f"resumed from the step-{newest} checkpoint" in logs[0], logs[0][-3000:]
    assert f"holds checkpoints up to step {older[-1]}" in logs[1], logs[1][-3000:]
    assert "entered the running job" in logs[1] and "resumed from" not in logs[1]

    rows = [folder_metrics(f) for f in folders]
    joined = [r for r in rows[1] if r.get("joined")]
    assert len(joined) == 1, joined
    # node 0 continues after the newest step: its next outer row is the round after it
    after = sorted(r["step"] for r in outer_by_step(rows[0]).values() if r["step"] > newest)
    assert after and after[0] == newest + H, after
    # from its entry on (its first contribution is the round after), node 1 writes the
    # outer step's hash that node 0 wrote, one per outer step, to the run's end
    mine = {k: r for k, r in outer_by_step(rows[1]).items() if r["step"] > newest}
    theirs = outer_by_step(rows[0])
    assert min(r["step"] for r in mine.values()) == joined[0]["step"], (mine, joined)
    # (told to stop together, one node may commit one round more, alone, as the other leaves)
    both = {k: r for k, r in mine.items() if k in theirs}
    assert sum(r["contributors"] == 2 for r in both.values()) >= ROUNDS_TOGETHER, (mine, theirs)
    assert len(mine) - len(both) <= 1, (sorted(mine), sorted(theirs))
    assert {k: r["outer_sha256"] for k, r in both.items()} == {
        k: theirs[k]["outer_sha256"] for k in both
    }, (mine, theirs)
