"""Test driver: a node process that runs mesh commands from a queue, and a cluster of them.

Each node runs one ElasticDeviceMesh (heartbeat 0.5 s / timeout 3 s, as the issue asks) and
plain gloo collectives on `mesh.global_pg`, sliced with `work.wait(timedelta)` so it can
notice `should_abort()` and its deadline, and reports every outcome to the test.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from datetime import timedelta
from typing import Any

HB_INTERVAL, HB_TIMEOUT = 0.5, 3.0
BOUND = 2 * HB_TIMEOUT + 5  # the loose bound for every failure path


def _mesh(coordinator: str, token: str, kwargs: dict):
    from prime_mesh import ElasticDeviceMesh

    kwargs = {"host": "127.0.0.1", **kwargs}
    return ElasticDeviceMesh(
        coordinator,
        token=token,
        heartbeat_interval=HB_INTERVAL,
        heartbeat_timeout=HB_TIMEOUT,
        **kwargs,
    )


def tcp_endpoints() -> dict[str, set[str]]:
    """IPv4 addresses of this process's TCP sockets (local and remote ends), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])

    def ip(hexaddr: str) -> str:
        h = hexaddr.split(":")[0]
        return ".".join(str(int(h[i : i + 2], 16)) for i in (6, 4, 2, 0))

    ends: dict[str, set[str]] = {"local": set(), "remote": set()}
    with open("/proc/self/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if parts[9] in inodes:
                ends["local"].add(ip(parts[1]))
                ends["remote"].add(ip(parts[2]))
    return ends


def node_main(name: str, coordinator: str, token: str, cmds, out, kwargs: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if "env" in kwargs:
        os.environ.update(kwargs.pop("env"))
    if "local_store" in kwargs:  # intra-node default group, as torchrun would set up
        host, port, lr, lws = kwargs.pop("local_store")
        store = dist.TCPStore(host, port, lws, lr == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=lr, world_size=lws)
    mesh: Any = None
    held: dict = {}  # the last group used, to show it survives the coordinator's loss

    def report(kind: str, **kw: Any) -> None:
        out.put((name, kind, {"t": time.time(), **kw}))

    def info() -> dict:
        return {
            "node_id": mesh.node_id,
            "rank": mesh.global_rank,
            "world": mesh.global_world_size,
            "epoch": mesh.epoch,
        }

    def error(e: BaseException) -> None:
        report("error", type=type(e).__name__, msg=str(e))

    try:
        mesh = _mesh(coordinator, token, kwargs)
        report("joined", **info())
    except Exception as e:
        error(e)
        return
    while True:
        cmd, arg = cmds.get()
        try:
            if cmd == "exit":
                return
            elif cmd == "allreduce":
                t = torch.full((arg.get("n", 1 << 16),), float(arg["value"]))
                pg, world = mesh.global_pg, mesh.global_world_size
                held.update(pg=pg, world=world)
                start = time.monotonic()
                work = dist.all_reduce(t, group=pg, async_op=True)
                if arg.get("then") == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)  # stalls mid-collective
                elif arg.get("then") == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                deadline = start + arg.get("timeout", mesh.collective_timeout())
                outcome, detail = None, ""
                while outcome is None:
                    try:
                        work.wait(timedelta(seconds=0.2))
                        outcome = "ok"
                    except RuntimeError as e:
                        if "timed out" not in str(e).lower():
                            outcome, detail = "failed", str(e)[:200]
                    if outcome is None and mesh.should_abort():
                        outcome = "aborted"
                    elif outcome is None and time.monotonic() > deadline:
                        outcome = "deadline"
                elapsed = time.monotonic() - start
                mesh.record_collective(elapsed, ok=outcome == "ok")
                if outcome == "ok":
                    report("ok", mean=float(t[0]) / world, elapsed=elapsed, **info())
                else:
                    report(outcome, elapsed=elapsed, detail=detail, **info())
            elif cmd == "plain_allreduce":  # no mesh call at all
                t = torch.full((16,), float(arg["value"]))
                dist.all_reduce(t, group=held["pg"], async_op=True).wait(timedelta(seconds=30))
                report("ok", mean=float(t[0]) / held["world"])
            elif cmd == "compute":  # busy main thread: heartbeats must keep going meanwhile
                end = time.monotonic() + arg["seconds"]
                a = torch.randn(256, 256)
                while time.monotonic() < end:
                    sum(i * i for i in range(20000))  # pure Python, holds the GIL
                    a = (a @ a).tanh()
                report("computed")
            elif cmd == "reinit":
                start = time.monotonic()
                changed = mesh.maybe_reinit_global_pg(admit_joiners=arg.get("admit", True))
                report("reinit", changed=changed, elapsed=time.monotonic() - start, **info())
            elif cmd == "vote":
                report("vote", result=mesh.should_commit(arg["ok"]))
            elif cmd == "members":
                report("members", members=mesh.members())
            elif cmd == "check":
                report("check", abort=mesh.should_abort())
            elif cmd == "sockets":
                report("sockets", **{k: sorted(v) for k, v in tcp_endpoints().items()})
            elif cmd == "close":
                mesh.close()
                report("closed")
            elif cmd == "rejoin":
                old, mesh = mesh, None
                old.close()
                mesh = _mesh(coordinator, token, arg.get("kwargs", {}))
                report("joined", **info())
            elif cmd == "local":
                lm = mesh.local_mesh
                report(
                    "local", size=lm.size(), local_rank=mesh.local_rank, lws=mesh.local_world_size
                )
        except Exception as e:
            error(e)


class Cluster:
    """N node processes driven from the test, plus the shared result queue."""

    def __init__(self, children, coordinator: str, token: str) -> None:
        self.children, self.coordinator, self.token = children, coordinator, token
        self.out = children.queue()
        self.cmds: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}
        self._pending: list[tuple[str, str, dict]] = []

    def start(self, name: str, **kwargs: Any) -> None:
        self.cmds[name] = self.children.queue()
        self.procs[name] = self.children.process(
            node_main, name, self.coordinator, self.token, self.cmds[name], self.out, kwargs
        )

    def send(self, names, cmd: str, **arg: Any) -> None:
        for n in [names] if isinstance(names, str) else names:
            self.cmds[n].put((cmd, arg))

    def get(self, name: str, timeout: float = 60.0) -> tuple[str, dict]:
        """Next report from `name` (other nodes' reports are kept for later)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, (n, kind, kw) in enumerate(self._pending):
                if n == name:
                    del self._pending[i]
                    return kind, kw
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no report from {name} within {timeout:.0f}s")
            try:
                self._pending.append(self.out.get(timeout=min(left, 1.0)))
            except queue.Empty:
                pass

    def expect(self, name: str, kind: str, timeout: float = 60.0) -> dict:
        got, kw = self.get(name, timeout)
        assert got == kind, f"{name}: expected {kind}, got {got} {kw}"
        return kw

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.procs[name].pid, sig)
