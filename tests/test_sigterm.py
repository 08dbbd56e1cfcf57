"""A SIGTERM to one node mid-round (a spot machine's notice): it leaves at once, saves, exits 0,
and the same command rejoins later through live recovery; the other node never waits for a
heartbeat timeout. (Every node stopped together resumes exactly: test_diloco_train.py.)

The coordinator is its own `prime-mesh coordinator` process; each node is its own `prime-train`
process in its own folder, as on its own machine.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prime_testkit import cli_node, free_port, wait_until
from prime_train.metrics import read_metrics

TOKEN = "sigterm-test-token"
H = 40  # a round of several seconds here, far longer than stop_within_s below
STEPS = 200
# heartbeats that would take a minute to notice a vanished node: the survivor must not wait
SLOW_HEARTBEATS = {"PRIME_MESH__HEARTBEAT_TIMEOUT_S": "120"}


def rows(folder: Path) -> list[dict]:
    path = folder / "runs" / "debug" / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log"))
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sigterm_mid_round_leaves_at_once_and_the_same_command_rejoins(tmp_path, children):
    port, cache = free_port(), tmp_path / "cache"
    with open(tmp_path / "coordinator.log", "w") as out:
        children.popen(
            [sys.executable, "-m", "prime_mesh.cli", "coordinator", "--host", "127.0.0.1",
             "--port", str(port), "--min-nodes", "2"],
            env=dict(os.environ, PRIME_TOKEN=TOKEN), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def start(folder: Path) -> subprocess.Popen:
        argv, env = cli_node(
            folder, coordinator=f"127.0.0.1:{port}", host="127.0.0.1", token=TOKEN, cache=cache,
            steps=STEPS, inner_steps=H, env=SLOW_HEARTBEATS,
            args=("--train.stop_within_s", "1", "--ckpt.every", "0"),
        )  # fmt: skip
        with open(folder.with_suffix(".log"), "a") as out:
            return children.popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=folder)

    n0, n1 = tmp_path / "a", tmp_path / "b"
    p0, p1 = start(n0), start(n1)
    wait_until(lambda: any("outer_step" in r for r in rows(n1)) or p1.poll() is not None,
               240, what="the first outer step")  # fmt: skip
    assert p0.poll() is None and p1.poll() is None, logs(tmp_path)

    p1.send_signal(signal.SIGTERM)
    assert p1.wait(timeout=30) == 0, logs(tmp_path)  # within 30 s, cleanly
    left = (n1.with_suffix(".log")).read_text()
    assert "SIGTERM received: left the mesh and checkpointed step 40" in left, left[-2000:]

    # the survivor commits alone at its next boundary, long before a heartbeat timeout
    def alone() -> bool:
        return any(r.get("nodes") == 1 for r in rows(n0) if "outer_step" in r)

    wait_until(lambda: alone() or p0.poll() is not None, 90, what="the survivor to go on alone")
    assert alone(), logs(tmp_path)
    assert "left gracefully" in (tmp_path / "coordinator.log").read_text(), logs(tmp_path)

    p1 = start(n1)  # the same command: rejoins through live recovery
    assert p1.wait(timeout=300) == 0 and p0.wait(timeout=120) == 0, logs(tmp_path)
    joined = [r for r in rows(n1) if r.get("joined")]
    assert joined and joined[0]["fetch_bytes"] > 0, logs(tmp_path)
    entry = joined[0]["step"]
    hashes = {
        n.name: {r["outer_step"]: r["outer_sha256"] for r in rows(n) if "outer_step" in r}
        for n in (n0, n1)
    }
    after = {k: v for k, v in hashes["b"].items() if k > 1 and v}
    assert after, hashes["b"]
    for k, digest in after.items():
        assert hashes["a"][k] == digest, f"outer step {k} differs after the rejoin at {entry}"
