"""How does one `prime-mesh coordinator` hold a swarm of N nodes?

What is real: the coordinator (the `prime-mesh coordinator` process, default heartbeats 1 s /
timeout 5 s), its rendezvous TCPStore, and the nodes' side of the wire protocol: each
simulated node is the project's own `Session` and `CoordinatorClient` (HMAC handshake,
registration, heartbeats in their own thread, a TCPStore client of the coordinator's store,
sync points, commit votes, leave), all in this one process. What is simulated: the nodes do
no training and build no gloo group (a round is a sync point then a vote, back to back).
The crash and stall figures use one extra node in a child process (SIGKILL, SIGSTOP).

Phases, each timed from this process's clock:
  storm     N nodes register at once (the coordinator waits for --min-nodes N): until one
            epoch holds all N, and until every node also holds its store client (the epochs
            it took; nodes that failed and came back)
  idle      5 s of heartbeats only: heartbeat round trip p50/p99, coordinator CPU, threads,
            open files
  rounds    sync point + vote, back to back: p50/p99 per node
  leave     10% of the nodes leave at once while rounds go on: the epochs that cost; then
            as many new nodes join: until all N are members again
  crash     a member's process is SIGKILLed: until the epoch without it
  stall     a member's process is SIGSTOPped: until it is evicted

    uv run python benchmarks/swarm.py [--nodes 16 64 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from prime_mesh.client import CoordinatorClient
from prime_mesh.errors import MeshError
from prime_mesh.session import Session

TOKEN = "swarm-benchmark-token"
HB_INTERVAL, HB_TIMEOUT = 1.0, 5.0


class CoordinatorProcess:
    """`prime-mesh coordinator` on a free port, and what /proc says about it."""

    def __init__(self, min_nodes: int) -> None:
        exe = Path(sys.executable).parent / "prime-mesh"
        cmd = [str(exe), "coordinator", "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--min-nodes", str(min_nodes)]
        env = {**os.environ, "PRIME_TOKEN": TOKEN}
        self.log = open(os.devnull, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "listening on" in line:
                self.address = line.split("listening on ")[1].split()[0]
                break
        else:
            raise RuntimeError("the coordinator did not start")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def threads(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
        return -1

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


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


class SimNode:
    """One simulated node: a real Session, and a thread running rounds while `rounds_on`."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
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
                self.session = new_session(self.swarm.address)
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
                if not self.swarm.rounds_on.wait(0.2):
                    continue
                try:
                    self._rounds()
                except (MeshError, OSError):  # evicted (or refused): come back as a new node
                    if self.stop.is_set():
                        return
                    assert self.session is not None
                    self.session.client.close()
                    self.retries += 1
                    self._join()
        except (MeshError, OSError) as e:
            self.swarm.failures.append(str(e))

    def _rounds(self) -> None:
        s = self.session
        assert s is not None
        installed, seq, skip_sync = None, 0, False
        while self.swarm.rounds_on.is_set() and not self.stop.is_set():
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
            time.sleep(self.swarm.round_gap)

    def leave(self) -> None:
        self.stop.set()
        if self.session is not None:
            self.session.close()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Swarm:
    """N simulated nodes against one coordinator process, and an observer asking its status."""

    def __init__(self, n: int, round_gap: float) -> None:
        self.n, self.round_gap = n, round_gap
        self.coord = CoordinatorProcess(min_nodes=n)
        self.address = self.coord.address
        self.rounds_on = threading.Event()
        self.failures: list[str] = []
        self.nodes: list[SimNode] = []
        self.observer = CoordinatorClient(self.address, TOKEN.encode())
        self.status()  # now: a connection silent past the handshake deadline is dropped

    def status(self) -> dict:
        return self.observer.request({"type": "status"}, timeout=30)["status"]

    def members(self) -> tuple[int, int]:
        """(epoch, members in it) as the coordinator says."""
        st = self.status()
        return st["epoch"], sum(1 for v in st["nodes"] if v["state"] == "member")

    def wait_members(
        self, count: int, timeout: float, nodes: list[SimNode] | None = None
    ) -> float | None:
        """Seconds until the epoch holds `count` members and every one of `nodes` has joined
        (None: not within `timeout`)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if all(n.joined.is_set() for n in nodes or []) and self.members()[1] == count:
                return time.monotonic() - t0
            time.sleep(0.02)
        return None

    def add(self, count: int) -> list[SimNode]:
        new = [SimNode(self) for _ in range(count)]
        self.nodes += new
        for node in new:
            node.thread.start()
        return new

    def storm(self) -> dict:
        t0 = time.monotonic()
        self.add(self.n)
        formed = self.wait_members(self.n, 120)
        took = self.wait_members(self.n, 120, self.nodes)
        epoch = self.members()[0]
        return {
            "storm_epoch_s": formed,
            "storm_s": took if took is None or formed is None else formed + took,
            "storm_epochs": epoch,
            "storm_retries": sum(n.retries for n in self.nodes),
            "storm_total_s": time.monotonic() - t0,
        }

    def idle(self, seconds: float = 5.0) -> dict:
        for node in self.nodes:
            node.hb_rtt.clear()
        cpu0, t0 = self.coord.cpu_s(), time.monotonic()
        time.sleep(seconds)
        cpu = (self.coord.cpu_s() - cpu0) / (time.monotonic() - t0)
        rtt = [x for node in self.nodes for x in node.hb_rtt]
        return {
            "hb_p50_ms": 1e3 * pct(rtt, 0.5),
            "hb_p99_ms": 1e3 * pct(rtt, 0.99),
            "idle_cpu_pct": 100 * cpu,
            "threads": self.coord.threads(),
            "open_files": self.coord.open_files(),
        }

    def rounds(self, seconds: float = 6.0) -> dict:
        for node in self.nodes:
            node.round_s.clear()
        cpu0, t0 = self.coord.cpu_s(), time.monotonic()
        self.rounds_on.set()
        time.sleep(seconds)
        cpu = (self.coord.cpu_s() - cpu0) / (time.monotonic() - t0)
        per = [x for node in self.nodes for x in node.round_s]
        return {
            "round_p50_ms": 1e3 * pct(per, 0.5),
            "round_p99_ms": 1e3 * pct(per, 0.99),
            "rounds": len(per) / max(1, self.n),
            "rounds_cpu_pct": 100 * cpu,
        }

    def leave_rejoin(self) -> dict:
        """10% leave at once (rounds going on); then as many join."""
        k = max(1, self.n // 10)
        epoch0, _ = self.members()
        leaving, self.nodes = self.nodes[:k], self.nodes[k:]
        t0 = time.monotonic()
        threads = [threading.Thread(target=node.leave) for node in leaving]
        for t in threads:
            t.start()
        gone = self.wait_members(self.n - k, 60)
        gone_s = None if gone is None else time.monotonic() - t0
        for t in threads:
            t.join(30)
        time.sleep(1.0)  # later epochs that the leaving still caused
        epoch1, _ = self.members()
        back_s = self.wait_members(self.n, 60, self.add(k))
        epoch2, _ = self.members()
        return {
            "leave_epochs": epoch1 - epoch0,
            "leave_s": gone_s,
            "rejoin_s": back_s,
            "rejoin_epochs": epoch2 - epoch1,
        }

    def fault(self, sig: int) -> float | None:
        """Seconds from `sig` to a member's child process until the epoch no longer holds it."""
        child = subprocess.Popen(
            [sys.executable, __file__, "--child", self.address, str(self.round_gap)]
        )
        try:
            if self.wait_members(self.n + 1, 60) is None:
                return None
            time.sleep(1.0)  # a few rounds with it
            child.send_signal(sig)
            took = self.wait_members(self.n, 30)
            return took
        finally:
            child.kill()
            child.wait()

    def close(self) -> None:
        self.rounds_on.clear()
        for node in self.nodes:
            node.stop.set()
        for node in self.nodes:
            node.thread.join(10)
        for node in self.nodes:
            if node.session is not None:
                node.session.client.close()
        self.observer.close()
        self.coord.close()


class _ChildSwarm:
    """What a SimNode needs, in the child process of the crash and stall phases."""

    def __init__(self, address: str, round_gap: float) -> None:
        self.address, self.round_gap = address, round_gap
        self.rounds_on = threading.Event()
        self.rounds_on.set()
        self.failures: list[str] = []


def child(address: str, round_gap: float) -> None:
    node = SimNode(_ChildSwarm(address, round_gap))  # type: ignore[arg-type]
    node.thread.start()
    node.thread.join()


def measure(n: int, round_gap: float) -> dict:
    swarm = Swarm(n, round_gap)
    try:
        out = {"nodes": n, **swarm.storm()}
        out |= swarm.idle()
        out |= swarm.rounds()
        out |= swarm.leave_rejoin()
        out["crash_s"] = swarm.fault(signal.SIGKILL)
        out["stall_s"] = swarm.fault(signal.SIGSTOP)
        out["threads_end"] = swarm.coord.threads()
        out["failures"] = len(swarm.failures)
        return out
    finally:
        swarm.close()


ROWS = [
    (
        "join storm: one epoch of all N / every store connected (s)",
        ("storm_epoch_s", "storm_s"),
        "{:.2f} / {:.2f}",
    ),
    ("  epochs / node retries", ("storm_epochs", "storm_retries"), "{} / {}"),
    ("coordinator threads (idle / end)", ("threads", "threads_end"), "{} / {}"),
    ("coordinator open files", "open_files", "{}"),
    ("heartbeat p50 / p99 (ms)", ("hb_p50_ms", "hb_p99_ms"), "{:.1f} / {:.1f}"),
    (
        "coordinator CPU idle / rounds (% core)",
        ("idle_cpu_pct", "rounds_cpu_pct"),
        "{:.1f} / {:.1f}",
    ),
    ("sync + vote p50 / p99 (ms)", ("round_p50_ms", "round_p99_ms"), "{:.0f} / {:.0f}"),
    ("10% leave at once: epochs / s", ("leave_epochs", "leave_s"), "{} / {:.2f}"),
    ("  as many join: back to N (s) / epochs", ("rejoin_s", "rejoin_epochs"), "{:.2f} / {}"),
    ("crash (SIGKILL) noticed (s)", "crash_s", "{:.2f}"),
    ("stall (SIGSTOP) evicted (s)", "stall_s", "{:.2f}"),
]


def table(results: list[dict]) -> str:
    lines = ["| | " + " | ".join(f"N = {r['nodes']}" for r in results) + " |"]
    lines.append("| --- |" + " --- |" * len(results))
    for label, keys, fmt in ROWS:
        keys = keys if isinstance(keys, tuple) else (keys,)
        cells = []
        for r in results:
            vals = [r.get(k) for k in keys]
            cells.append("n/a" if None in vals else fmt.format(*vals))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], float(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--round-gap", type=float, default=0.2, help="seconds between a node's rounds")
    ap.add_argument("--json", action="store_true", help="also print each N's figures as JSON")
    args = ap.parse_args()
    results = []
    for n in args.nodes:
        r = measure(n, args.round_gap)
        results.append(r)
        if args.json:
            print(json.dumps(r), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
