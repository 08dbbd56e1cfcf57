"""Run several simulated nodes on one machine: a coordinator plus N nodes of R ranks each.

The coordinator is its own process (`prime_train.local_coordinator`), restarted if it dies.

Each node is its own torch.distributed world of R rank processes (as if on its own machine,
FSDP2 across its ranks), the cores are split over the N x R processes, and each process's
output is prefixed with `[node k]` (`[node k rank r]`). A node is its ranks together: when one
rank exits with an error, the node's other ranks are ended too (they would otherwise wait in
an intra-node collective). Ctrl-C (or SIGTERM) is forwarded once to every process so each
node finishes its step, checkpoints and exits; a second Ctrl-C, or processes still running
after `grace` seconds, are killed.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from prime_train.datasets import LOCAL_PROCESSES_ENV
from prime_train.lifetime import die_with_parent
from prime_train.placement import NODE_ENV  # a node started with it never launches more


@dataclass
class RankProcess:
    node: int
    rank: int
    proc: subprocess.Popen

    @property
    def name(self) -> str:
        return f"node {self.node} rank {self.rank}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out, errors: list[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        # a carriage-return progress bar becomes its latest state on one prefixed line
        line = line.rsplit("\r", 1)[-1]
        if line.startswith("prime-train: "):  # a node's one-line error for a user mistake
            errors.append(line)
        # the trainer's own lines already say "[node k rank r]"; tracebacks and others do not
        out.write(f"{line}\n" if line.startswith("[node ") else f"{prefix}{line}\n")
        out.flush()
    stream.close()


def launch_local_nodes(
    node_argv: Sequence[str],
    nodes: int,
    coordinator: Callable[[int], AbstractContextManager[Any]],
    grace: float = 120.0,
    extra_env: dict[str, str] | None = None,
    ranks_per_node: int = 1,
) -> int:
    """Start `coordinator(nodes)` (a context manager yielding an object with `.address` and
    `.status()`, as `prime_train.local_coordinator.local_coordinator` does), then `nodes`
    nodes of `ranks_per_node` processes running `python -m prime_train.cli *node_argv`;
    return 0 only if every process exited 0."""
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"need at least 1 node of 1 rank, got {nodes} x {ranks_per_node}")
    threads = max(1, (os.cpu_count() or 1) // (nodes * ranks_per_node))
    token = os.environ.get("PRIME_TOKEN") or secrets.token_hex(32)
    stop_requests = 0
    ranks: list[RankProcess] = []

    def on_signal(signum, frame):  # frame is None when a node's error, not Ctrl-C, stops the run
        nonlocal stop_requests
        stop_requests += 1
        if stop_requests == 1 and frame is not None:
            print(
                "[launch] stopping: each node finishes its step and checkpoints "
                "(Ctrl-C again to kill)",
                file=sys.stderr,
                flush=True,
            )
        _signal_all(signal.SIGINT if stop_requests == 1 else signal.SIGKILL, ranks)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    pumps: list[threading.Thread] = []
    errors: list[str] = []
    try:
        os.environ["PRIME_TOKEN"] = token  # the coordinator process reads it too
        with coordinator(nodes) as coord:
            address = coord.address
            shape = f"{nodes} nodes" + (f" of {ranks_per_node} ranks" if ranks_per_node > 1 else "")
            print(
                f"[launch] coordinator at {address}; starting {shape}, "
                f"{threads} torch thread(s) per process",
                flush=True,
            )
            for k in range(nodes):
                env = _node_env(k, address, token, threads, (nodes, ranks_per_node), extra_env)
                node_ranks = [_start_rank(node_argv, env, k, r, ranks_per_node)
                              for r in range(ranks_per_node)]  # fmt: skip
                pumps += [_pump_output(r, ranks_per_node, errors) for r in node_ranks]
                ranks.extend(node_ranks)
                # one registration at a time: node k gets rank k, so reruns sum in the same order
                _wait_registered(coord, k + 1, [r.proc for r in node_ranks])
            codes = _wait_all(
                ranks,
                lambda: stop_requests > 0,
                grace,
                on_user_error=on_signal,
                end_node=lambda k: _signal_all(signal.SIGKILL, [r for r in ranks if r.node == k]),
            )
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for r in ranks:
            if r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait(timeout=10)
        for t in pumps:
            t.join(timeout=5)
    return _exit_code(codes, errors)


def _signal_all(sig: int, which: Sequence[RankProcess]) -> None:
    """Send `sig` to the process groups of the ranks in `which` still running."""
    for r in which:
        if r.proc.poll() is None:
            try:
                os.killpg(r.proc.pid, sig)
            except ProcessLookupError:
                pass


def _pump_output(r: RankProcess, ranks_per_node: int, errors: list[str]) -> threading.Thread:
    """A thread copying rank r's output to ours, each line prefixed with who speaks."""
    prefix = f"[node {r.node}] " if ranks_per_node == 1 else f"[node {r.node} rank {r.rank}] "
    t = threading.Thread(
        target=_pump, args=(r.proc.stdout, prefix, sys.stdout, errors), daemon=True
    )
    t.start()
    return t


def _node_env(
    k: int,
    address: str,
    token: str,
    threads: int,
    shape: tuple[int, int],
    extra_env: dict[str, str] | None,
) -> dict[str, str]:
    """Simulated node k's environment: the mesh's address and secret, its index, its threads,
    and, with several ranks, its own torch.distributed world as torchrun sets it. `shape`:
    (nodes, ranks per node) on this machine."""
    nodes, ranks_per_node = shape
    env = {
        **os.environ,
        **(extra_env or {}),
        NODE_ENV: str(k),
        "PRIME_TOKEN": token,
        "PRIME_MESH__COORDINATOR": address,
        "PRIME_MESH__HOST": "127.0.0.1",
        "OMP_NUM_THREADS": str(threads),
        LOCAL_PROCESSES_ENV: str(nodes * ranks_per_node),  # tokenizer workers' share
        "PYTHONUNBUFFERED": "1",
    }
    if ranks_per_node > 1:
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            WORLD_SIZE=str(ranks_per_node),
            LOCAL_WORLD_SIZE=str(ranks_per_node),
        )
    return env


def _start_rank(
    node_argv: Sequence[str], node_env: dict[str, str], k: int, r: int, ranks_per_node: int
) -> RankProcess:
    """Start local rank r of node k (`python -m prime_train.cli`), its output piped."""
    env = dict(node_env)
    if ranks_per_node > 1:
        env.update(RANK=str(r), LOCAL_RANK=str(r))
    p = subprocess.Popen(
        [sys.executable, "-m", "prime_train.cli", *node_argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    return RankProcess(k, r, p)


def _exit_code(codes: dict[str, int], errors: list[str]) -> int:
    """0 if every process exited 0; 2 (the config or data error said once, as one node would)
    if any exited 2; else 1, naming the processes that failed."""
    if 2 in codes.values():
        for line in dict.fromkeys(errors):
            print(line, file=sys.stderr, flush=True)
        return 2
    for name, code in codes.items():
        if code != 0:
            print(f"[launch] {name} exited with code {code}", file=sys.stderr, flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


def _wait_registered(
    coord: Any, count: int, procs: list[subprocess.Popen], timeout: float = 300.0
) -> None:
    deadline = time.monotonic() + timeout
    while len(coord.status()["nodes"]) < count:
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            return  # a rank died or is slow: its exit code or the mesh will say why
        time.sleep(0.2)


def _wait_all(
    ranks: list[RankProcess],
    stopping: Callable[[], bool],
    grace: float,
    on_user_error: Callable[[int, Any], None],
    end_node: Callable[[int], None],
) -> dict[str, int]:
    """Wait for every rank; once a stop was requested, give them `grace` seconds, then kill.
    A rank that exits 2 (a user mistake the others share) stops the rest instead of leaving
    them waiting for a peer that will never come; a rank that fails ends its node's other
    ranks."""
    stop_seen_at = None
    ended: set[int] = set()
    while any(r.proc.poll() is None for r in ranks):
        if not stopping() and any(r.proc.returncode == 2 for r in ranks):
            on_user_error(signal.SIGINT, None)
        for r in ranks:
            code = r.proc.returncode
            if code not in (None, 0) and r.node not in ended:
                ended.add(r.node)
                siblings = [s for s in ranks if s.node == r.node and s.proc.poll() is None]
                if siblings:
                    print(
                        f"[launch] {r.name} exited with code {code}; ending node {r.node}'s "
                        "other ranks",
                        file=sys.stderr,
                        flush=True,
                    )
                    end_node(r.node)
        if stopping() and stop_seen_at is None:
            stop_seen_at = time.monotonic()
        if stop_seen_at is not None and time.monotonic() - stop_seen_at > grace:
            print(
                f"[launch] nodes still running {grace:.0f}s after stop; killing them",
                file=sys.stderr,
                flush=True,
            )
            for r in ranks:
                if r.proc.poll() is None:
                    os.killpg(r.proc.pid, signal.SIGKILL)
        time.sleep(0.1)
    single = all(r.rank == 0 for r in ranks)
    return {(f"node {r.node}" if single else r.name): r.proc.returncode for r in ranks}
