"""Run several simulated nodes on one machine: a coordinator plus N node processes.

Each node is its own process (its own torch.distributed world, as if on its own machine), gets
cores/N torch threads, and its output is prefixed with `[node k]`. Ctrl-C (or SIGTERM) is
forwarded once to every node so each finishes its step, checkpoints and exits; a second
Ctrl-C, or nodes still running after `grace` seconds, are killed.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from prime_train.diloco_node import NODE_ENV  # a node started with it never launches more


def _die_with_parent() -> None:
    os.setpgid(0, 0)  # our own group: a terminal's Ctrl-C reaches only the launcher
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


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
) -> int:
    """Start `coordinator(nodes)` (a context manager yielding a Coordinator), then `nodes` processes
    running `python -m prime_train.cli *node_argv`; return 0 only if every node exited 0."""
    if nodes < 1:
        raise ValueError(f"launch.local_nodes must be at least 1, got {nodes}")
    threads_per_node = max(1, (os.cpu_count() or 1) // nodes)
    token = os.environ.get("PRIME_TOKEN") or secrets.token_hex(32)
    stop_requests = 0
    procs: list[subprocess.Popen] = []

    def on_signal(signum, frame):  # frame is None when a node's error, not Ctrl-C, stops the run
        nonlocal stop_requests
        stop_requests += 1
        sig = signal.SIGINT if stop_requests == 1 else signal.SIGKILL
        if stop_requests == 1 and frame is not None:
            print(
                "[launch] stopping: each node finishes its step and checkpoints "
                "(Ctrl-C again to kill)",
                file=sys.stderr,
                flush=True,
            )
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    pumps: list[threading.Thread] = []
    errors: list[str] = []
    try:
        os.environ["PRIME_TOKEN"] = token  # the in-process coordinator reads it too
        with coordinator(nodes) as coord:
            address = coord.address
            print(
                f"[launch] coordinator at {address}; starting {nodes} nodes, "
                f"{threads_per_node} torch thread(s) each",
                flush=True,
            )
            for k in range(nodes):
                env = dict(os.environ)
                env.update(extra_env or {})
                env.update(
                    {
                        NODE_ENV: str(k),
                        "PRIME_TOKEN": token,
                        "PRIME_MESH__COORDINATOR": address,
                        "PRIME_MESH__HOST": "127.0.0.1",
                        "OMP_NUM_THREADS": str(threads_per_node),
                        "PYTHONUNBUFFERED": "1",
                    }
                )
                p = subprocess.Popen(
                    [sys.executable, "-m", "prime_train.cli", *node_argv],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent,
                )
                procs.append(p)
                # one registration at a time: node k gets rank k, so reruns sum in the same order
                _wait_registered(coord, k + 1, p)
                t = threading.Thread(
                    target=_pump, args=(p.stdout, f"[node {k}] ", sys.stdout, errors), daemon=True
                )
                t.start()
                pumps.append(t)
            codes = _wait_all(procs, lambda: stop_requests > 0, grace, on_user_error=on_signal)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for t in pumps:
            t.join(timeout=5)
    if 2 in codes:  # a mistake in the config or data: say it once, like a single node would
        for line in dict.fromkeys(errors):
            print(line, file=sys.stderr, flush=True)
        return 2
    for k, code in enumerate(codes):
        if code != 0:
            print(f"[launch] node {k} exited with code {code}", file=sys.stderr, flush=True)
    return 0 if all(c == 0 for c in codes) else 1


def _wait_registered(coord: Any, count: int, proc: subprocess.Popen, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while len(coord.status()["nodes"]) < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            return  # the node died or is slow: its exit code or the mesh will say why
        time.sleep(0.05)


def _wait_all(
    procs: list[subprocess.Popen],
    stopping: Callable[[], bool],
    grace: float,
    on_user_error: Callable[[int, Any], None],
):
    """Wait for every node; once a stop was requested, give them `grace` seconds, then kill.
    A node that exits 2 (a user mistake the others share) stops the rest instead of leaving
    them waiting for a peer that will never come."""
    stop_seen_at = None
    while any(p.poll() is None for p in procs):
        if not stopping() and any(p.returncode == 2 for p in procs):
            on_user_error(signal.SIGINT, None)
        if stopping() and stop_seen_at is None:
            stop_seen_at = time.monotonic()
        if stop_seen_at is not None and time.monotonic() - stop_seen_at > grace:
            print(
                f"[launch] nodes still running {grace:.0f}s after stop; killing them",
                file=sys.stderr,
                flush=True,
            )
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.1)
    return [p.returncode for p in procs]


@contextmanager
def local_coordinator(nodes: int, status_port: int | None = None) -> Iterator[Any]:
    """A mesh coordinator in this process for `nodes` local nodes (has .address, .status());
    with `status_port`, it also serves the status page on 127.0.0.1 and prints its URL."""
    import logging

    from prime_mesh import Coordinator

    # membership changes are progress for a person to read, beside the nodes' lines
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[coordinator] %(message)s"))
    mesh_log = logging.getLogger("prime_mesh")
    mesh_log.addHandler(handler)
    mesh_log.setLevel(logging.INFO)
    mesh_log.propagate = False

    coordinator = Coordinator("127.0.0.1", port=0, min_nodes=nodes).start()
    try:
        if status_port is not None:
            page = coordinator.serve_status("127.0.0.1", status_port)
            print(f"[launch] status page at {page.url}", flush=True)
        yield coordinator
    finally:
        coordinator.close()
