"""One DiLoCo job on the WAN bed for benchmarks/wan_chaos.py: the coordinator and every node as
its own process in its own namespace and working folder, the faults applied to them, and the
outer-step rows read back from each node's metrics.jsonl while it runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from wan_chaos_schedule import Event

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "wan-chaos-benchmark-token"
PORT = 29400
ROW_KEYS = ("outer_step", "eval_loss", "joined")  # the metrics rows the report reads


def _grace_known() -> bool:
    """Whether this checkout's trainer has `mesh.coordinator_grace_s` (coordinator restart)."""
    from prime_train.config import MeshConfig

    return "coordinator_grace_s" in MeshConfig.model_fields


class Job:
    """`nodes` nodes at first (bed nodes 0..nodes-1), spares for `add`, and the coordinator in
    the bed's last namespace."""

    def __init__(self, bed, workdir: Path, nodes: int, args, children) -> None:
        self.bed, self.dir, self.args, self.children = bed, workdir, args, children
        self.first_nodes = nodes
        self.coord_k = bed.nodes - 1
        self.coordinator = f"{bed.ip(self.coord_k)}:{PORT}"
        self.procs: dict[int, subprocess.Popen] = {}
        self.coord_proc: subprocess.Popen | None = None
        self.next_spare = nodes
        self.rows: dict[int, dict[str, dict]] = {}  # node -> every outer row ever seen
        self.timeline: list[dict] = []
        self.t0 = time.time()
        self.first_commit: float | None = None
        self.lives: dict[int, list[float]] = {}  # node -> start times of its processes
        self.every_proc: list[tuple[int, subprocess.Popen]] = []  # each node process started
        self.killed: set[int] = set()  # pids this job SIGKILLed (their exit is not theirs)
        # node k's fault hooks (environment), in every process of it: benchmarks/churn.py
        self.faults: dict[int, dict[str, str]] = getattr(args, "faults", {})

    # --- processes ---------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = dict(
            os.environ,
            PRIME_TOKEN=TOKEN,
            GLOO_SOCKET_IFNAME="eth0",
            OMP_NUM_THREADS="1",
            TORCH_CPP_LOG_LEVEL="ERROR",  # a namespace has no hostname to resolve
            PRIME_MESH__HEARTBEAT_INTERVAL_S=str(self.args.heartbeat_interval),
            PRIME_MESH__HEARTBEAT_TIMEOUT_S=str(self.args.heartbeat_timeout),
        )
        if _grace_known():
            env["PRIME_MESH__COORDINATOR_GRACE_S"] = str(self.args.coordinator_grace)
        env.pop("PRIME_LOCAL_NODE", None)
        return env

    def start_coordinator(self) -> None:
        cmd = [sys.executable, "-m", "prime_mesh.cli", "coordinator", "--host", "0.0.0.0",
               "--port", str(PORT), "--advertise-host", self.bed.ip(self.coord_k),
               "--min-nodes", str(self.first_nodes)]  # fmt: skip
        log = open(self.dir / "coordinator.log", "a")  # noqa: SIM115 - the child holds it
        self.coord_proc = self.children.popen(
            self.bed.exec_prefix(self.coord_k) + cmd,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def node_dir(self, k: int) -> Path:
        return self.dir / f"node{k}"

    def start_node(self, k: int) -> None:
        a = self.args
        folder = self.node_dir(k)
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "prime_train.cli",
               "--config", str(ROOT / "configs" / "debug.toml"),
               "--model.preset", a.model,
               "--run.runs_dir", str(folder / "runs"),
               "--data.cache_dir", str(self.dir / "token-cache"),
               "--train.steps", str(a.steps),
               "--diloco.inner_steps", str(a.inner_steps),
               "--ckpt.every", str(2 * a.inner_steps),
               "--eval.every", str(a.eval_every),
               "--run.log_every", str(a.inner_steps),
               "--mesh.coordinator", self.coordinator,
               "--mesh.host", self.bed.ip(k),
               "--mesh.node_name", f"node{k}",
               *(["--mesh.serve_mbit", str(a.serve_mbit)] if a.serve_mbit else []),
               *getattr(a, "extra_args", ())]  # fmt: skip
        log = open(self.dir / f"node{k}.log", "a")  # noqa: SIM115 - the child holds it
        self.procs[k] = self.children.popen(
            self.bed.exec_prefix(k) + cmd, env={**self.env(), **self.faults.get(k, {})}, stdout=log,
            stderr=subprocess.STDOUT, cwd=folder,
        )  # fmt: skip
        log.close()
        self.every_proc.append((k, self.procs[k]))
        self.lives.setdefault(k, []).append(time.time())

    def start(self) -> None:
        self.start_coordinator()
        for k in range(self.first_nodes):
            self.start_node(k)

    def _signal(self, proc: subprocess.Popen | None, sig: int) -> None:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, sig)  # the node's whole process group, by its leader's pid

    def apply(self, e: Event, progress) -> None:
        """Apply one event now and add it to the timeline."""
        if e.kind == "kill":
            self.killed.add(self.procs[e.node].pid)
            self._signal(self.procs[e.node], signal.SIGKILL)
            self.procs[e.node].wait(timeout=30)
        elif e.kind == "term":
            self._signal(self.procs[e.node], signal.SIGTERM)
        elif e.kind == "stop":
            for k in self.running():
                self._signal(self.procs[k], signal.SIGTERM)
        elif e.kind == "restart":
            self.procs[e.node].wait(timeout=120)  # a SIGTERMed node finishes its checkpoint
            self.start_node(e.node)
        elif e.kind == "stall":
            p = self.procs[e.node]
            self._signal(p, signal.SIGSTOP)
            threading.Timer(e.seconds, self._signal, (p, signal.SIGCONT)).start()
        elif e.kind == "cut":
            self.bed.link_down(e.node)
        elif e.kind == "restore":
            self.bed.link_up(e.node)
        elif e.kind == "add":
            e = Event(e.when, e.at, e.kind, self.next_spare)
            self.start_node(self.next_spare)
            self.next_spare += 1
        elif e.kind == "kill-coordinator":
            self._signal(self.coord_proc, signal.SIGKILL)
            self.coord_proc.wait(timeout=30)
        elif e.kind == "restart-coordinator":
            self.start_coordinator()
        entry = {"t": time.time() - self.t0, "event": e.label(), "kind": e.kind, "node": e.node,
                 "outer_step": self.frontier(), "members": self.members()}  # fmt: skip
        self.timeline.append(entry)
        progress(f"EVENT {entry['event']} at outer step {entry['outer_step']}, "
                 f"{entry['members']} member(s)")  # fmt: skip

    def rerun_if_asked(self, progress) -> None:
        """A node that exited saying "rerun the same command" (a joiner whose fetch outlasted a
        round) is rerun, as its operator or a supervisor would, at most twice; the rerun is
        marked in the timeline and counted in the result (not with `args.rerun = False`: a
        node's exit is then checked as it is)."""
        if not getattr(self.args, "rerun", True):
            return
        for k, p in list(self.procs.items()):
            if p.poll() in (None, 0, -signal.SIGKILL) or not self.running():
                continue
            tail = (self.dir / f"node{k}.log").read_text()[-600:]
            said = next((ln for ln in tail.splitlines() if "erun the same command" in ln), None)
            reruns = sum(1 for e in self.timeline if e["kind"] == "rerun" and e["node"] == k)
            if said is None or reruns >= 2 or getattr(p, "_rerun", False):
                continue
            p._rerun = True  # type: ignore[attr-defined]
            self.start_node(k)
            entry = {"t": time.time() - self.t0, "event": f"rerun node{k}", "kind": "rerun",
                     "node": k, "outer_step": self.frontier(), "members": self.members(),
                     "exit": p.returncode, "said": said.strip()}  # fmt: skip
            self.timeline.append(entry)
            progress(f"RERUN node{k}: it exited {p.returncode} saying {said.strip()!r}")

    def running(self) -> list[int]:
        return [k for k, p in self.procs.items() if p.poll() is None]

    def stop_coordinator(self) -> None:
        if self.coord_proc is not None and self.coord_proc.poll() is None:
            self.coord_proc.terminate()
            try:
                self.coord_proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._signal(self.coord_proc, signal.SIGKILL)
                self.coord_proc.wait(timeout=15)

    # --- what the nodes wrote ----------------------------------------------------------
    def poll_rows(self) -> list[dict]:
        """Read every node's metrics; return the outer rows not seen before. Rows are kept
        even when a restarted node truncates its file to its resume step."""
        new = []
        for k in self.procs:
            path = self.node_dir(k) / "runs" / "debug" / "metrics.jsonl"
            if not path.is_file():
                continue
            seen = self.rows.setdefault(k, {})
            for line in path.read_text().splitlines():
                if line in seen or not any(f'"{key}"' in line for key in ROW_KEYS):
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line being written
                row["node"] = k
                seen[line] = row
                new.append(row)
        for r in new:
            if "outer_step" in r and self.first_commit is None:
                self.first_commit = r["time"]
        return new

    def outer_rows(self) -> list[dict]:
        return sorted(
            (r for rows in self.rows.values() for r in rows.values() if "outer_step" in r),
            key=lambda r: r["time"],
        )

    def joined_rows(self) -> list[dict]:
        """The rows a node writes as it enters the running job (its join's timeline)."""
        return sorted(
            (r for rows in self.rows.values() for r in rows.values() if r.get("joined")),
            key=lambda r: r["time"],
        )

    def frontier(self) -> int:
        return max((r["outer_step"] for r in self.outer_rows()), default=0)

    def holds_alone(self, k: int | None) -> bool:
        """Whether node `k` wrote the newest outer step's row while it had one contributor."""
        rows = [r for r in self.outer_rows() if r["outer_step"] == self.frontier()]
        return any(r["node"] == k for r in rows) and min(r["contributors"] for r in rows) == 1

    def members(self) -> int:
        rows = self.outer_rows()
        return rows[-1]["nodes"] if rows else 0

    def train_rows(self) -> dict[int, list[dict]]:
        """Every node's step rows with a train loss (for the loss-vs-time plot)."""
        out = {}
        for k in self.procs:
            path = self.node_dir(k) / "runs" / "debug" / "metrics.jsonl"
            from prime_train.metrics import read_metrics

            out[k] = [r for r in read_metrics(path) if "loss" in r]
        return out
