"""How does one `prime-mesh coordinator` hold a swarm of N nodes?

What is real: the coordinator (the `prime-mesh coordinator` process, default heartbeats 1 s /
timeout 5 s), its rendezvous TCPStore, and the nodes' side of the wire protocol: each
simulated node is the project's own `Session` and `CoordinatorClient` (HMAC handshake,
registration, heartbeats in their own thread, a TCPStore client of the coordinator's store,
sync points, commit votes, leave; see swarm_nodes.py). What is simulated: the nodes do no
training and build no gloo group (a round is a sync point then a vote, back to back), and
they live in worker processes, at most --per-worker nodes each (1024 nodes: 8 processes),
which this process drives over pipes. The crash and stall figures use one extra node in a
child process (SIGKILL, SIGSTOP).

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

    uv run python benchmarks/swarm.py [--nodes 16 64 256 1024] [--per-worker 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from swarm_nodes import TOKEN, worker_main

from prime_mesh.client import CoordinatorClient

NODES = Path(__file__).with_name("swarm_nodes.py")


class CoordinatorProcess:
    """`prime-mesh coordinator` on a free port, and what /proc says about it."""

    def __init__(self, min_nodes: int) -> None:
        exe = Path(sys.executable).parent / "prime-mesh"
        cmd = [str(exe), "coordinator", "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--min-nodes", str(min_nodes)]
        env = {**os.environ, "PRIME_TOKEN": TOKEN}
        fd, name = tempfile.mkstemp(prefix="swarm-coordinator-", suffix=".log")
        self.log, self.log_path = os.fdopen(fd, "w"), Path(name)  # closed in close()
        self.keep_log = False  # (kept once its tail was printed: a failure to look into)
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

    def tail(self, lines: int = 30) -> str:
        """Where the coordinator is (running, or its exit code) and the end of its log."""
        self.log.flush()
        code = self.proc.poll()
        state = "running" if code is None else f"exited with {code}"
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        self.keep_log = True
        return f"coordinator {state}; {self.log_path}:\n" + "\n".join(text)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Workers:
    """Worker processes (`swarm_nodes.worker_main`) holding the simulated nodes, spread evenly;
    every answer is awaited within a bound, and every process is reaped in `close()`."""

    def __init__(self, count: int, address: str, round_gap: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for _ in range(count):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(theirs, address, round_gap, os.getpid()), daemon=True
            )
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)

    def split(self, total: int) -> list[int]:
        w = len(self.conns)
        return [total // w + (1 if i < total % w else 0) for i in range(w)]

    def ask(self, cmd: str, args: list | None = None, timeout: float = 60.0) -> list:
        """Send `cmd` (with `args[i]` to worker i) to every worker; their answers, in order."""
        for i, conn in enumerate(self.conns):
            conn.send((cmd, None if args is None else args[i]))
        deadline, out = time.monotonic() + timeout, []
        for i, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"swarm worker {i} did not answer {cmd!r} within {timeout} s")
            out.append(conn.recv())
        return out

    def close(self) -> None:
        try:
            self.ask("stop", timeout=60)
        except (TimeoutError, OSError, EOFError):
            pass  # killed below
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for conn in self.conns:
            conn.close()


class Swarm:
    """N simulated nodes in worker processes against one coordinator process, and an
    observer asking the coordinator's status."""

    def __init__(self, n: int, round_gap: float, workers: int) -> None:
        self.n, self.round_gap = n, round_gap
        self.coord = CoordinatorProcess(min_nodes=n)
        self.address = self.coord.address
        self.workers: Workers | None = None
        self.observer = CoordinatorClient(self.address, TOKEN.encode())
        self.status()  # now: a connection silent past the handshake deadline is dropped
        self.workers = Workers(workers, self.address, round_gap)
        self.workers.ask("joined", timeout=120)  # each has imported torch and is listening

    def status(self) -> dict:
        return self.observer.request({"type": "status"}, timeout=30)["status"]

    def members(self) -> tuple[int, int]:
        """(epoch, members in it) as the coordinator says."""
        st = self.status()
        return st["epoch"], sum(1 for v in st["nodes"] if v["state"] == "member")

    def all_joined(self) -> bool:
        """Whether every simulated node holds its session and its store client."""
        assert self.workers is not None
        return all(j == total for j, total in self.workers.ask("joined"))

    def wait_members(self, count: int, timeout: float, joined: bool = False) -> float | None:
        """Seconds until the epoch holds `count` members (and, with `joined`, every simulated
        node holds its store client); None: not within `timeout`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.members()[1] == count and (not joined or self.all_joined()):
                return time.monotonic() - t0
            time.sleep(0.05)
        return None

    def add(self, count: int) -> None:
        assert self.workers is not None
        self.workers.ask("add", self.workers.split(count))

    def samples(self) -> dict[str, list[float]]:
        assert self.workers is not None
        out: dict[str, list[float]] = {"hb": [], "round": []}
        for answer in self.workers.ask("samples"):
            for key in out:
                out[key] += answer[key]
        return out

    def stats(self) -> tuple[int, list[str]]:
        """(node retries, failures) so far, over every worker."""
        assert self.workers is not None
        answers = self.workers.ask("stats")
        return sum(a["retries"] for a in answers), [f for a in answers for f in a["failures"]]

    def storm(self) -> dict:
        t0 = time.monotonic()
        self.add(self.n)
        formed = self.wait_members(self.n, 120)
        took = self.wait_members(self.n, 120, joined=True)
        epoch = self.members()[0]
        return {
            "storm_epoch_s": formed,
            "storm_s": took if took is None or formed is None else formed + took,
            "storm_epochs": epoch,
            "storm_retries": self.stats()[0],
            "storm_total_s": time.monotonic() - t0,
        }

    def idle(self, seconds: float = 5.0) -> dict:
        assert self.workers is not None
        self.workers.ask("clear")
        cpu0, t0 = self.coord.cpu_s(), time.monotonic()
        time.sleep(seconds)
        cpu = (self.coord.cpu_s() - cpu0) / (time.monotonic() - t0)
        rtt = self.samples()["hb"]
        return {
            "hb_p50_ms": 1e3 * pct(rtt, 0.5),
            "hb_p99_ms": 1e3 * pct(rtt, 0.99),
            "idle_cpu_pct": 100 * cpu,
            "threads": self.coord.threads(),
            "open_files": self.coord.open_files(),
        }

    def rounds(self, seconds: float = 6.0) -> dict:
        assert self.workers is not None
        self.workers.ask("clear")
        cpu0, t0 = self.coord.cpu_s(), time.monotonic()
        self.workers.ask("rounds", [True] * len(self.workers.conns))
        time.sleep(seconds)
        cpu = (self.coord.cpu_s() - cpu0) / (time.monotonic() - t0)
        per = self.samples()["round"]
        return {
            "round_p50_ms": 1e3 * pct(per, 0.5),
            "round_p99_ms": 1e3 * pct(per, 0.99),
            "rounds": len(per) / max(1, self.n),
            "rounds_cpu_pct": 100 * cpu,
        }

    def leave_rejoin(self) -> dict:
        """10% leave at once (rounds going on); then as many join."""
        assert self.workers is not None
        k = max(1, self.n // 10)
        epoch0, _ = self.members()
        t0 = time.monotonic()
        self.workers.ask("leave", self.workers.split(k))
        gone = self.wait_members(self.n - k, 60)
        gone_s = None if gone is None else time.monotonic() - t0
        self.workers.ask("left", [30.0] * len(self.workers.conns), timeout=40)
        time.sleep(1.0)  # later epochs that the leaving still caused
        epoch1, _ = self.members()
        self.add(k)
        back_s = self.wait_members(self.n, 60, joined=True)
        epoch2, _ = self.members()
        return {
            "leave_epochs": epoch1 - epoch0,
            "leave_s": gone_s,
            "rejoin_s": back_s,
            "rejoin_epochs": epoch2 - epoch1,
        }

    def fault(self, sig: int) -> float | None:
        """Seconds from `sig` to a member's child process until the epoch no longer holds it."""
        child = subprocess.Popen([sys.executable, str(NODES), self.address, str(self.round_gap)])
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
        if self.workers is not None:
            self.workers.close()
        self.observer.close()
        self.coord.close()


def measure(n: int, round_gap: float, per_worker: int) -> dict:
    workers = max(1, math.ceil(n / per_worker))
    t0 = time.monotonic()
    swarm = Swarm(n, round_gap, workers)
    phases = {"start": time.monotonic() - t0}

    def timed(name: str, figures: dict) -> dict:
        phases[name] = time.monotonic() - t0 - sum(phases.values())
        return figures

    try:
        out = {"nodes": n, "workers": workers, **timed("storm", swarm.storm())}
        out |= timed("idle", swarm.idle())
        out |= timed("rounds", swarm.rounds())
        out |= timed("leave", swarm.leave_rejoin())
        out["crash_s"] = timed("crash", {"s": swarm.fault(signal.SIGKILL)})["s"]
        out["stall_s"] = timed("stall", {"s": swarm.fault(signal.SIGSTOP)})["s"]
        out["threads_end"] = swarm.coord.threads()
        out["failures"] = len(swarm.stats()[1])
    except Exception:
        print(swarm.coord.tail(), file=sys.stderr, flush=True)
        raise
    finally:
        swarm.close()
    out["phases_s"] = {k: round(v, 1) for k, v in timed("close", phases).items()}
    return out


ROWS = [
    ("simulator worker processes", "workers", "{}"),
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--round-gap", type=float, default=0.2, help="seconds between a node's rounds")
    ap.add_argument(
        "--per-worker", type=int, default=128, help="simulated nodes per worker process (at most)"
    )
    ap.add_argument("--json", action="store_true", help="also print each N's figures as JSON")
    args = ap.parse_args()
    results = []
    for n in args.nodes:
        r = measure(n, args.round_gap, args.per_worker)
        results.append(r)
        if args.json:
            print(json.dumps(r), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
