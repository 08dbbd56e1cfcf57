"""Nodes joining a running prime-train job through live checkpoint recovery, through the CLI.

Each node is its own process with its own working folder (runs_dir and checkpoints), as on
its own machine, started with the same command; a coordinator runs in the test process.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prime_mesh import Coordinator
from prime_testkit import wait_until
from prime_train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "diloco-join-test-token"
H = 10
STEPS = 240


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("token-cache")


def node_args(folder: Path, cache: Path) -> list[str]:
    return [
        "--config", str(ROOT / "configs" / "debug.toml"),
        "--run.runs_dir", str(folder / "runs"),
        "--data.cache_dir", str(cache),
        "--train.steps", str(STEPS),
        "--diloco.inner_steps", str(H),
        "--ckpt.every", "40",  # not every boundary: a waiting joiner asks for one
        "--eval.every", "0",
        "--run.log_every", "10",
    ]  # fmt: skip


def start(children, folder: Path, name: str, address: str, cache: Path, log: Path, extra=()):
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PRIME_TOKEN=TOKEN, PRIME_MESH__COORDINATOR=address,
               PRIME_MESH__HOST="127.0.0.1", PRIME_MESH__NODE_NAME=name,
               PRIME_MESH__HEARTBEAT_INTERVAL_S="0.5", PRIME_MESH__HEARTBEAT_TIMEOUT_S="3",
               OMP_NUM_THREADS="1")  # fmt: skip
    env.pop("PRIME_LOCAL_NODE", None)
    with open(log, "a") as out:
        return children.popen(
            [sys.executable, "-m", "prime_train.cli", *node_args(folder, cache), *extra],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=folder,
        )  # fmt: skip


def rows(folder: Path) -> list[dict]:
    return read_metrics(folder / "runs" / "debug" / "metrics.jsonl")


def outer(folder: Path) -> dict[int, dict]:
    return {r["outer_step"]: r for r in rows(folder) if "outer_step" in r}


def start_pair(children, tmp_path, coord, cache):
    nodes = {}
    for k in range(2):
        nodes[k] = start(children, tmp_path / f"node{k}", f"node{k}", coord.address, cache,
                         tmp_path / f"node{k}.log")  # fmt: skip
        wait_until(lambda n=k: len(coord.status()["nodes"]) > n, 120, what=f"node {k} registers")
    return nodes


def logs(tmp_path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(tmp_path.glob("*.log"))
    )


def check_entry(tmp_path, joiner: Path, members: list[Path]) -> int:
    """The joiner's first committed outer step has the members' hash, and every later one."""
    mine = outer(joiner)
    assert mine, logs(tmp_path)
    first = min(mine)
    for m in members:
        theirs = outer(m)
        for k, r in mine.items():
            if k in theirs:
                assert r["outer_sha256"] == theirs[k]["outer_sha256"], (k, logs(tmp_path))
        assert first in theirs
    joined = [r for r in rows(joiner) if r.get("joined")]
    assert joined and joined[0]["fetch_bytes"] > 0 and joined[0]["donor"], joined
    return first


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_third_node_joins_a_running_two_node_job(tmp_path, token_cache, children):
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        nodes = start_pair(children, tmp_path, coord, token_cache)
        n0 = tmp_path / "node0"
        wait_until(lambda: 2 in outer(n0) or nodes[0].poll() is not None, 240,
                   what="the members' second outer step")  # fmt: skip
        assert nodes[0].poll() is None, logs(tmp_path)
        joiner = start(children, tmp_path / "node2", "node2", coord.address, token_cache,
                       tmp_path / "node2.log")  # fmt: skip
        codes = [p.wait(timeout=300) for p in (nodes[0], nodes[1], joiner)]
    finally:
        coord.close()
    assert codes == [0, 0, 0], logs(tmp_path)
    n2 = tmp_path / "node2"
    first = check_entry(tmp_path, n2, [n0, tmp_path / "node1"])
    assert first > 2
    entry = outer(n0)[first]
    assert entry["nodes"] == 3 and entry["contributors"] == 2, entry
    assert outer(n0)[max(outer(n0))]["nodes"] == 3
    assert outer(n0)[max(outer(n0))]["contributors"] == 3
    assert outer(n2)[max(outer(n2))]["outer_sha256"] == outer(n0)[max(outer(n0))]["outer_sha256"]
    log = (tmp_path / "node2.log").read_text()
    assert "entered the running job at outer step" in log and "MB/s" in log


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_node_run_again_rejoins(tmp_path, token_cache, children):
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        nodes = start_pair(children, tmp_path, coord, token_cache)
        n0, n1 = tmp_path / "node0", tmp_path / "node1"
        # node 1 holds its own step-40 checkpoint, then dies
        wait_until(lambda: (n1 / "runs" / "debug" / "ckpt" / "step-0000000040").is_dir()
                   or nodes[1].poll() is not None, 240, what="node 1's step-40 checkpoint")  # fmt: skip
        nodes[1].send_signal(signal.SIGKILL)
        nodes[1].wait(timeout=30)
        died_at = max(outer(n1))
        wait_until(lambda: any(r["nodes"] == 1 for r in outer(n0).values())
                   or nodes[0].poll() is not None, 120, what="node 0 going on alone")  # fmt: skip
        assert nodes[0].poll() is None, logs(tmp_path)
        again = start(children, n1, "node1", coord.address, token_cache, tmp_path / "node1.log")
        codes = [p.wait(timeout=300) for p in (nodes[0], again)]
    finally:
        coord.close()
    assert codes == [0, 0], logs(tmp_path)
    first_after = min(k for k, r in outer(n1).items() if k > died_at and "outer_sha256" in r)
    assert first_after > died_at
    check_entry(tmp_path, n1, [n0])
    assert outer(n0)[first_after]["nodes"] == 2 and outer(n0)[first_after]["contributors"] == 1
    assert outer(n1)[max(outer(n1))]["outer_sha256"] == outer(n0)[max(outer(n0))]["outer_sha256"]


def check_rejoined(tmp_path, node: Path, members: list[Path], times: int = 1) -> int:
    """The node's rows say it rejoined `times` times by itself, the last entry fetched a
    member's state, and from that entry on every outer step has the members' hash. Returns
    the inner step it re-entered at."""
    rejoined = [r for r in rows(node) if r.get("rejoined")]
    assert [r["rejoined"] for r in rejoined] == list(range(1, times + 1)), logs(tmp_path)
    last = rejoined[-1]
    assert last["joined"] and last["fetch_bytes"] > 0 and last["donor"], last
    after = [r for r in rows(node) if "outer_sha256" in r and r["step"] >= last["step"]]
    assert after, logs(tmp_path)
    for m in members:
        theirs = outer(m)
        for r in after:
            assert r["outer_sha256"] == theirs[r["outer_step"]]["outer_sha256"], (
                r["outer_step"],
                logs(tmp_path),
            )
    return int(last["step"])


def stall_node_1_until_node_0_goes_on_alone(nodes, n0: Path, n1: Path) -> int:
    """SIGSTOP node 1 after its second outer step, SIGCONT it once node 0 committed alone;
    returns node 0's last outer step before the stall."""
    wait_until(lambda: 2 in outer(n1) or nodes[1].poll() is not None, 240,
               what="node 1's second outer step")  # fmt: skip
    nodes[1].send_signal(signal.SIGSTOP)
    try:
        stalled_at = max(outer(n0))
        wait_until(lambda: any(r["nodes"] == 1 for k, r in outer(n0).items() if k > stalled_at)
                   or nodes[0].poll() is not None, 120, what="node 0 going on alone")  # fmt: skip
    finally:
        nodes[1].send_signal(signal.SIGCONT)
    return stalled_at


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stalled_node_is_evicted_and_rejoins_by_itself(tmp_path, token_cache, children):
    """SIGSTOP a node past the heartbeat timeout, SIGCONT it: evicted, it rejoins through live
    recovery without being restarted (the same process), and ends with the member's weights."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        nodes = start_pair(children, tmp_path, coord, token_cache)
        n0, n1 = tmp_path / "node0", tmp_path / "node1"
        stalled_at = stall_node_1_until_node_0_goes_on_alone(nodes, n0, n1)
        alone = [k for k, r in outer(n0).items() if k > stalled_at and r["nodes"] == 1]
        codes = [p.wait(timeout=300) for p in (nodes[0], nodes[1])]
    finally:
        coord.close()
    assert codes == [0, 0], logs(tmp_path)
    assert alone, logs(tmp_path)  # the member committed while the straggler was out
    entry = check_rejoined(tmp_path, n1, [n0])
    back = min(r["outer_step"] for r in rows(n1) if "outer_sha256" in r and r["step"] >= entry)
    assert back > max(alone)  # it re-entered after the rounds it missed, not in their place
    assert outer(n0)[back]["nodes"] == 2 and outer(n0)[back]["contributors"] == 1
    log = (tmp_path / "node1.log").read_text()
    assert "lost the mesh membership" in log and "reentered the running job" in log, log[-3000:]
    assert outer(n1)[max(outer(n1))]["outer_sha256"] == outer(n0)[max(outer(n0))]["outer_sha256"]
    assert outer(n0)[max(outer(n0))]["nodes"] == 2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_past_its_rejoin_bound_exits_1_with_a_clear_line(tmp_path, token_cache, children):
    """With diloco.max_rejoins = 0 the woken straggler does not rejoin: it says why and exits
    1, and the member finishes alone."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=2).start()
    try:
        n0, n1 = tmp_path / "node0", tmp_path / "node1"
        nodes = {
            0: start(children, n0, "node0", coord.address, token_cache, tmp_path / "node0.log")
        }
        wait_until(lambda: len(coord.status()["nodes"]) > 0, 120, what="node 0 registers")
        nodes[1] = start(children, n1, "node1", coord.address, token_cache,
                         tmp_path / "node1.log", extra=["--diloco.max_rejoins", "0"])  # fmt: skip
        stall_node_1_until_node_0_goes_on_alone(nodes, n0, n1)
        codes = [p.wait(timeout=300) for p in (nodes[0], nodes[1])]
    finally:
        coord.close()
    assert codes == [0, 1], logs(tmp_path)
    log = (tmp_path / "node1.log").read_text()
    assert "lost its mesh membership 1 times" in log and "diloco.max_rejoins = 0" in log, log[
        -3000:
    ]
    assert not [r for r in rows(n1) if r.get("rejoined")]
    assert outer(n0)[max(outer(n0))]["nodes"] == 1
