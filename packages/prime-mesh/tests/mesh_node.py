"""Test driver: a node process that runs mesh commands from a queue (prime_testkit.Nodes).

Each node runs one ElasticDeviceMesh (heartbeat 0.5 s / timeout 3 s: shorter than the
defaults, so failures show quickly) and plain gloo collectives on `mesh.global_pg`, sliced
with `work.wait(timedelta)` so it can notice `should_abort()` and its deadline, and reports
every outcome to the test.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from prime_testkit import Nodes, gloo_world

HB_INTERVAL, HB_TIMEOUT = 0.5, 3.0
# Every failure path must release the survivors within two heartbeat timeouts plus slack.
BOUND = 2 * HB_TIMEOUT + 5


def _mesh(coordinator: str, token: str, kwargs: dict):
    from prime_mesh import ElasticDeviceMesh

    kwargs = {"host": "127.0.0.1", **kwargs}
    if "node_name" in kwargs:  # `name` is the test's own name for the node process
        kwargs["name"] = kwargs.pop("node_name")
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
        gloo_world(lr, lws, port, host=host)
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

    def joined() -> None:
        if mesh.state == "member":
            report("joined", **info())
        else:  # wait_until_ready=True or wait=False: registered, not admitted
            report("registered", node_id=mesh.node_id, state=mesh.state)

    try:
        mesh = _mesh(coordinator, token, kwargs)
        joined()
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
                if arg.get("then") == "kill":
                    # Killed as it enters, so it never sends: killed just after, gloo's own
                    # thread may already have sent its share and the others' reduce completes.
                    os.kill(os.getpid(), signal.SIGKILL)
                work = dist.all_reduce(t, group=pg, async_op=True)
                if arg.get("then") == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)  # stalls mid-collective
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
            elif cmd == "note":  # the trainer's last committed outer step and weight hash
                mesh.note_outer_step(arg["outer_step"], arg["outer_hash"])
                report("noted")
            elif cmd == "ready":
                mesh.ready()
                report("ready", state=mesh.state)
            elif cmd == "vote":
                report("vote", result=mesh.should_commit(arg["ok"]))
            elif cmd == "members":
                report("members", members=mesh.members())
            elif cmd == "installed":  # the group this node last installed (no mesh call)
                epoch, members = mesh.installed_group
                report("installed", members=list(members), epoch=epoch, world=len(members))
            elif cmd == "check":
                report("check", abort=mesh.should_abort())
            elif cmd == "resources":  # open files and threads of this process, from /proc
                report(
                    "resources",
                    fds=len(os.listdir("/proc/self/fd")),
                    threads=len(os.listdir("/proc/self/task")),
                )
            elif cmd == "sockets":
                report("sockets", **{k: sorted(v) for k, v in tcp_endpoints().items()})
            elif cmd == "close":
                mesh.close()
                report("closed")
            elif cmd == "rejoin":
                old, mesh = mesh, None
                old.close()
                mesh = _mesh(coordinator, token, arg.get("kwargs", {}))
                joined()
            elif cmd == "local":
                lm = mesh.local_mesh
                report(
                    "local", size=lm.size(), local_rank=mesh.local_rank, lws=mesh.local_world_size
                )
        except Exception as e:
            error(e)


def coordinator_process(children, token: str, min_nodes: int):
    """`prime-mesh coordinator` on a free loopback port, as a child process: (process,
    address, a queue of its log lines)."""
    cli = str(Path(sys.executable).parent / "prime-mesh")
    env = {**os.environ, "PRIME_TOKEN": token}
    cmd = [cli, "coordinator", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--min-nodes", str(min_nodes)]
    proc = children.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    while True:
        line = lines.get(timeout=60)
        if "prime-mesh coordinator listening on" in line:
            return proc, line.split("listening on ")[1].split()[0], lines


def mesh_nodes(children, coordinator: str, token: str) -> Nodes:
    """Mesh node processes (node_main) joined to `coordinator`, driven from the test."""
    return Nodes(children, node_main, coordinator, token)
