"""The simulated nodes of benchmarks/swarm.py, and the worker process that runs a share of them.

Each simulated node is the project's own `Session` and `CoordinatorClient` (HMAC handshake,
registration, heartbeats in their own thread, a TCPStore client of the coordinator's store,
sync points, commit votes, leave); it trains nothing and builds no gloo group. A worker
process holds a share of the nodes and answers the driver's commands over a pipe; it exits
when told to, or when its driver is gone.

    python benchmarks/swarm_nodes.py ADDRESS ROUND_GAP   # one node (the crash and stall phases)
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections import deque
from typing import Any

from prime_mesh.errors import MeshError
from prime_mesh.session import Session

TOKEN = "swarm-benchmark-token"
HB_INTERVAL, HB_TIMEOUT = 1.0, 5.0


def new_session(address: str) -> Session:
    register = {
        "type": "register",
        "node_key": secrets.token_hex(8),
        "local_rank": 0,
        "local_world_size": 1,
        "metadata": {"config_hash": "swarm"},
        "heartbeat_timeout": HB_TIMEOUT,
        "sync_timeout": None,
    }
    return Session(
        address,
        TOKEN.encode(),
        register,
        first={"ready": True},
        host="127.0.0.1",
        local_rank=0,
        heartbeat_interval=HB_INTERVAL,
        heartbeat_timeout=HB_TIMEOUT,
        connect_timeout=10.0,
        pg_timeout=60.0,
    )


class NodeGroup:
    """The nodes of one process: what a SimNode shares with its siblings."""

    def __init__(self, address: str, round_gap: float) -> None:
        self.address, self.round_gap = address, round_gap
        self.rounds_on = threading.Event()
        self.failures: list[str] = []
        self.nodes: list[SimNode] = []
        self.leaving: list[threading.Thread] = []

    def add(self, count: int) -> int:
        new = [SimNode(self) for _ in range(count)]
        self.nodes += new
        for node in new:
            node.thread.start()
        return len(self.nodes)

    def leave(self, count: int) -> None:
        """`count` nodes leave at once (each from its own thread)."""
        leaving, self.nodes = self.nodes[:count], self.nodes[count:]
        self.leaving = [threading.Thread(target=n.leave, daemon=True) for n in leaving]
        for t in self.leaving:
            t.start()

    def handle(self, cmd: str, arg: Any) -> Any:
        """One command of the driver (see `worker_main`)."""
        if cmd == "add":
            return self.add(arg)
        if cmd == "joined":
            return [sum(n.joined.is_set() for n in self.nodes), len(self.nodes)]
        if cmd == "rounds":
            (self.rounds_on.set if arg else self.rounds_on.clear)()
        elif cmd == "clear":
            for node in self.nodes:
                node.hb_rtt.clear()
                node.round_s.clear()
        elif cmd == "samples":
            return {
                "hb": [x for n in self.nodes for x in n.hb_rtt],
                "round": [x for n in self.nodes for x in n.round_s],
            }
        elif cmd == "leave":
            self.leave(arg)
        elif cmd == "left":  # the leaving nodes' threads, within `arg` seconds
            deadline = time.monotonic() + arg
            for t in self.leaving:
                t.join(max(0.0, deadline - time.monotonic()))
            return sum(t.is_alive() for t in self.leaving)
        elif cmd == "stats":
            return {"retries": sum(n.retries for n in self.nodes), "failures": self.failures}
        return None

    def close(self, within: float = 20.0) -> None:
        """Stop every node and close its connection, all at once: a client's close waits up to
        a heartbeat interval for its heartbeat thread, so one after the other would take
        minutes at 128 nodes."""
        self.rounds_on.clear()
        for node in self.nodes:
            node.stop.set()
        deadline = time.monotonic() + within
        for node in self.nodes:
            node.thread.join(max(0.0, deadline - time.monotonic()))
        closing = [
            threading.Thread(target=node.session.client.close, daemon=True)
            for node in self.nodes
            if node.session is not None
        ]
        for t in closing:
            t.start()
        for t in closing:
            t.join(max(0.0, deadline + 5 - time.monotonic()))


class SimNode:
    """One simulated node: a real Session, and a thread running rounds while `rounds_on`."""

    def __init__(self, group: NodeGroup) -> None:
        self.group = group
        self.session: Session | None = None
        self.retries = 0
        self.hb_sent: deque[float] = deque()
        self.hb_rtt: list[float] = []
        self.round_s: list[float] = []
        self.stop = threading.Event()
        self.joined = threading.Event()  # registered and connected to the store
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _join(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            try:
                self.session = new_session(self.group.address)
                break
            except MeshError:
                self.retries += 1
                if time.monotonic() > deadline or self.stop.is_set():
                    raise
                time.sleep(0.5)
        client = self.session.client
        send, forward = client.channel.send, client.on_message

        def timed_send(msg: dict) -> None:
            if msg.get("type") == "hb":
                self.hb_sent.append(time.monotonic())
            send(msg)

        def on_message(msg: dict) -> None:
            if msg.get("type") == "ack" and self.hb_sent:
                self.hb_rtt.append(time.monotonic() - self.hb_sent.popleft())
            elif forward is not None:
                forward(msg)

        client.on_message = on_message
        client.channel.send = timed_send  # type: ignore[method-assign]
        self.joined.set()

    def _run(self) -> None:
        try:
            self._join()
            while not self.stop.is_set():
                if not self.group.rounds_on.wait(0.2):
                    continue
                try:
                    self._rounds()
                except (MeshError, OSError):  # evicted (or refused): come back as a new node
                    if self.stop.is_set():
                        return
                    assert self.session is not None
                    self.session.client.close()
                    self.retries += 1
                    self.joined.clear()
                    self._join()
        except (MeshError, OSError) as e:
            self.group.failures.append(str(e))

    def _rounds(self) -> None:
        s = self.session
        assert s is not None
        installed, seq, skip_sync = None, 0, False
        while self.group.rounds_on.is_set() and not self.stop.is_set():
            latest = s.latest
            if latest is None or s.node_id not in latest.members:
                s.client.wait_for(
                    lambda: s.latest is not None and s.node_id in s.latest.members, 0.5
                )
                s.check()
                continue
            if installed is None or latest.number > installed.number:
                skip_sync = installed is None and s.node_id in latest.joined
                installed, seq = latest, 0
            t0 = time.monotonic()
            if not skip_sync:
                msg = {"type": "sync", "epoch": installed.number, "admit": True}
                msg |= {"failed": False, "listening": False}
                reply = s.client.request(msg, timeout=s.request_bound)
                s.note_epoch(reply["epoch"])
                if s.latest is not None and s.latest.number > installed.number:
                    installed, seq = s.latest, 0
            skip_sync = False
            vote = {"type": "vote", "epoch": installed.number, "seq": seq, "ok": True}
            result = s.client.request(vote, timeout=s.request_bound)
            seq += 1
            if result.get("result"):
                self.round_s.append(time.monotonic() - t0)
            time.sleep(self.group.round_gap)

    def leave(self) -> None:
        self.stop.set()
        if self.session is not None:
            self.session.close()


def worker_main(conn: Any, address: str, round_gap: float, driver: int) -> None:
    """Serve the driver's commands over `conn` (a Pipe end) until "stop", or until the driver
    process (`driver`) is gone; each answer is the command's result."""
    group = NodeGroup(address, round_gap)
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != driver:  # the driver died: nobody will say "stop"
                    return
                continue
            cmd, arg = conn.recv()
            conn.send(group.handle(cmd, arg))
            if cmd == "stop":
                return
    except (EOFError, OSError):  # the driver closed its end
        pass
    finally:
        group.close()


def child(address: str, round_gap: float) -> None:
    """One node in its own process, running rounds (the crash and stall phases' victim)."""
    group = NodeGroup(address, round_gap)
    group.rounds_on.set()
    group.add(1)
    group.nodes[0].thread.join()


if __name__ == "__main__":
    child(sys.argv[1], float(sys.argv[2]))
