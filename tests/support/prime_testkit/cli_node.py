"""prime-train nodes run through the real CLI (`python -m prime_train.cli`), as a user runs them.

Two layouts of a job's nodes:
- `cli_node` / `start_cli_node`: a node in its own working folder, as on its own machine (its
  runs folder `folder/runs`, its name the folder's name; see prime_testkit.runs.folder_metrics);
- `start_local_node(s)`, `run_local_nodes`: node k of nodes that share one runs folder
  (PRIME_LOCAL_NODE=k, the local launcher's layout: metrics-node{k}.jsonl; see
  prime_testkit.runs.node_metrics).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prime_testkit.children import Children, wait_until

ROOT = Path(__file__).resolve().parents[3]
DEBUG_CONFIG = ROOT / "configs" / "debug.toml"
CLI = [sys.executable, "-m", "prime_train.cli"]
# every test node: heartbeats every 0.5 s, dropped after 3 s of silence; one thread of compute
MESH_ENV = {
    "PRIME_MESH__HEARTBEAT_INTERVAL_S": "0.5",
    "PRIME_MESH__HEARTBEAT_TIMEOUT_S": "3",
    "OMP_NUM_THREADS": "1",
}


def debug_args(runs: Path, cache: Path, *extra: str) -> list[str]:
    """CLI arguments of a configs/debug.toml run in `runs` with its token cache in `cache`
    (`extra` adds to or overrides them)."""
    return [
        "--config", str(DEBUG_CONFIG),
        "--run.runs_dir", str(runs),
        "--data.cache_dir", str(cache),
        *extra,
    ]  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without PRIME_* settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    return {**env, **extra}


def cli_node(
    folder: Path,
    *,
    coordinator: str,
    host: str,
    token: str,
    cache: Path,
    steps: int,
    inner_steps: int,
    env: dict[str, str] | None = None,
    args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a node working in `folder` (created; its name is the
    node name): configs/debug.toml, heartbeats every 0.5 s with a 3 s timeout, a checkpoint
    every 40 steps, no evaluation; `env` and `args` add to or override them."""
    folder.mkdir(parents=True, exist_ok=True)
    node_env = dict(os.environ, PRIME_TOKEN=token, PRIME_MESH__COORDINATOR=coordinator,
                    PRIME_MESH__HOST=host, PRIME_MESH__NODE_NAME=folder.name)  # fmt: skip
    node_env.update(MESH_ENV)
    node_env.update(env or {})
    node_env.pop("PRIME_LOCAL_NODE", None)  # not a node of a local launcher
    argv = [
        *CLI,
        *debug_args(folder / "runs", cache),
        "--train.steps", str(steps),
        "--diloco.inner_steps", str(inner_steps),
        "--ckpt.every", "40",
        "--eval.every", "0",
        "--run.log_every", "10",
        *args,
    ]  # fmt: skip
    return argv, node_env


def start_cli_node(
    children: Children, folder: Path, *, prefix: Sequence[str] = (), **node: Any
) -> subprocess.Popen:
    """`cli_node(folder, **node)` started in `folder`, its output appended to the log beside
    it (`folder.with_suffix(".log")`: node0/ logs to node0.log); `prefix` goes before the
    command (a network namespace's `ip netns exec NS`)."""
    argv, env = cli_node(folder, **node)
    with open(folder.with_suffix(".log"), "a") as out:  # the child keeps its own copy of it
        return children.popen([*prefix, *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
                              cwd=folder)  # fmt: skip


def start_nodes_in_turn(
    children: Children,
    folders: Sequence[Path],
    coord: Any,
    envs: dict[int, dict[str, str]] | None = None,
    **node: Any,
) -> list[subprocess.Popen]:
    """`start_cli_node` in each folder against the in-process coordinator `coord`, each once
    the coordinator lists the ones before it (several torch start-ups at once starve the
    heartbeats on two cores); 120 s for each to register. `envs`: extra environment (fault
    hooks) by node index."""
    procs = []
    for k, folder in enumerate(folders):
        env = (envs or {}).get(k, {})
        procs.append(start_cli_node(children, folder, coordinator=coord.address, env=env, **node))
        wait_until(lambda k=k: len(coord.status()["nodes"]) > k, 120, what=f"node {k} registers")
    return procs


def start_ranked_node(
    children: Children, folder: Path, ranks: int, **node: Any
) -> list[subprocess.Popen]:
    """`cli_node(folder, **node)` as a node of `ranks` processes, as torchrun starts one on a
    machine of several GPUs (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), every rank's
    output appended to the log beside `folder`; returns the rank processes, rank 0 first."""
    from prime_testkit.children import free_port

    argv, env = cli_node(folder, **node)
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
             "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks)}  # fmt: skip
    procs = []
    with open(folder.with_suffix(".log"), "a") as out:
        for r in range(ranks):
            procs.append(children.popen(argv, env={**env, **world, "RANK": str(r),
                                                   "LOCAL_RANK": str(r)},
                                        stdout=out, stderr=subprocess.STDOUT, cwd=folder))  # fmt: skip
    return procs


def start_local_node(
    children: Children, k: int, *, coordinator: str, token: str, args: Sequence[str], log: Path,
    **env: str,
) -> subprocess.Popen:  # fmt: skip
    """`prime-train *args` as node `k` of nodes sharing one runs folder (PRIME_LOCAL_NODE=k), on
    127.0.0.1 with `coordinator`'s mesh; its output written to `log`; `env` adds settings."""
    node_env = dict(os.environ, PRIME_TOKEN=token, PRIME_LOCAL_NODE=str(k),
                    PRIME_MESH__COORDINATOR=coordinator, PRIME_MESH__HOST="127.0.0.1")  # fmt: skip
    node_env.update(MESH_ENV)
    node_env.update(env)
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return children.popen([*CLI, *args], env=node_env, stdout=out, stderr=subprocess.STDOUT)


def start_local_nodes(
    children: Children, coord: Any, *, token: str, args: Sequence[str], logs: Sequence[Path],
    **env: str,
) -> list[subprocess.Popen]:  # fmt: skip
    """Nodes 0..len(logs)-1 through `start_local_node` (node k logging to logs[k]) with the
    in-process Coordinator `coord`, each started once the one before registered: registered
    in node order, so ranks (and float sums) match across runs."""
    procs = []
    for k, log in enumerate(logs):
        procs.append(start_local_node(children, k, coordinator=coord.address, token=token,
                                      args=args, log=log, **env))  # fmt: skip
        wait_until(lambda n=k: len(coord.status()["nodes"]) > n, 120, what=f"node {k} to register")
    return procs


def run_local_nodes(
    children: Children, *, token: str, args: Sequence[str], logs: Sequence[Path],
    stop_when: Callable[[], bool] | None = None, what: str = "the moment to stop", **env: str,
) -> list[int]:  # fmt: skip
    """A whole job of `start_local_nodes` with an in-process Coordinator for all of them, run to
    its end; with `stop_when`, every node is sent SIGTERM once it holds (within 200 s: `what`
    names it). Returns the nodes' exit codes."""
    from prime_mesh import Coordinator

    coord = Coordinator("127.0.0.1", port=0, token=token, min_nodes=len(logs)).start()
    try:
        procs = start_local_nodes(children, coord, token=token, args=args, logs=logs, **env)
        if stop_when is not None:
            wait_until(stop_when, 200, what=what)
            for p in procs:
                p.send_signal(signal.SIGTERM)
        return [p.wait(timeout=200) for p in procs]
    finally:
        coord.close()


def start_coordinator_cli(
    children: Children, port: int, log: Path, token: str, min_nodes: int = 2
) -> subprocess.Popen:
    """`prime-mesh coordinator` on 127.0.0.1:`port` for `min_nodes` nodes, as its own process,
    its output appended to `log`."""
    args = ["coordinator", "--host", "127.0.0.1", "--port", str(port),
            "--min-nodes", str(min_nodes)]  # fmt: skip
    with open(log, "a") as out:
        return children.popen(
            [sys.executable, "-m", "prime_mesh.cli", *args],
            env=dict(os.environ, PRIME_TOKEN=token), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


class LineProc:
    """A child process (through `Children`, PRIME_TOKEN `token`) whose output lines a thread
    collects, each with its arrival time (`lines`)."""

    def __init__(
        self, children: Children, args: Sequence[str], token: str, cwd: Path | None = None
    ) -> None:
        env = {**os.environ, "PRIME_TOKEN": token, "PYTHONUNBUFFERED": "1"}
        self.p = children.popen(list(args), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def start_mesh_coordinator(
    children: Children, token: str, *extra: str, cwd: Path | None = None
) -> tuple[LineProc, str]:
    """`prime-mesh coordinator --host 127.0.0.1 --port 0 *extra`, once it printed where it
    listens (within 60 s): the process and its HOST:PORT."""
    cli = str(Path(sys.executable).parent / "prime-mesh")
    coord = LineProc(children, [cli, "coordinator", "--host", "127.0.0.1", "--port", "0", *extra],
                     token, cwd)  # fmt: skip

    def address() -> str | None:
        for _, line in coord.lines:
            if line.startswith("prime-mesh coordinator listening on "):
                return line.split("listening on ")[1].split()[0]
        return None

    wait_until(lambda: address() is not None or coord.p.poll() is not None, 60,
               what="the coordinator's address line")  # fmt: skip
    found = address()
    assert found is not None, coord.text()
    return coord, found


def stop_once_contributing(
    watch: Path, procs: Sequence[subprocess.Popen], contributors: int, timeout: float = 400
) -> list[int]:
    """Until a round in `watch`'s metrics (a node folder) had `contributors` contributors, or a
    process of `procs` ended; then SIGTERM to each (a node stops at its next outer boundary).
    Returns their exit codes."""
    from prime_testkit.runs import folder_metrics, outer_by_step

    def contributed() -> bool:
        rows = outer_by_step(folder_metrics(watch)).values()
        return any(r["contributors"] == contributors for r in rows) or any(
            p.poll() is not None for p in procs
        )

    wait_until(contributed, timeout, what=f"a round of {contributors} contributors")
    for p in procs:
        p.send_signal(signal.SIGTERM)
    return [p.wait(timeout=120) for p in procs]
