"""A WAN test bed on one machine: network namespaces joined through a bridge, each node's link
rate-limited with `tc tbf` (both directions). Root only; `netem` is not available on these
kernels, so latency is not emulated, bandwidth is.

    with WanBed(3, rate_mbit=100) as bed:
        p = subprocess.Popen(bed.exec_prefix(0) + [sys.executable, "worker.py", bed.ip(0)])
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid

SUBNET = "10.231.{bed}.{host}"


def bed_unavailable_reason() -> str | None:
    """Why a bed cannot be built here (None when it can): used as a pytest skip reason."""
    if os.geteuid() != 0:
        return "the WAN bed needs root (network namespaces and tc); CI runs as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the WAN bed needs the `{tool}` command (iproute2)"
    return None


def _run_checked(*args: str) -> None:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {r.stderr.strip()}")


class WanBed:
    """`nodes` namespaces on a shared bridge; every node link limited to `rate_mbit` each way."""

    def __init__(self, nodes: int, rate_mbit: float = 100.0, burst: str = "256kb") -> None:
        if not 1 <= nodes <= 200:
            raise ValueError("a WanBed holds 1 to 200 nodes")
        self.nodes = nodes
        self.rate_mbit = rate_mbit
        self.burst = burst  # tbf bucket: at a few Mbit/s keep it small, or it sends a burst free
        self.tag = uuid.uuid4().hex[:6]
        self.bed_octet = int(self.tag, 16) % 250 + 1
        self.bridge_ns = f"pb{self.tag}"
        self.node_ns = [f"pn{self.tag}{k}" for k in range(nodes)]
        self._made: list[str] = []

    def ip(self, k: int) -> str:
        return SUBNET.format(bed=self.bed_octet, host=k + 1)

    def exec_prefix(self, k: int) -> list[str]:
        """Prefix a command with this to run it inside node k's namespace."""
        return ["ip", "netns", "exec", self.node_ns[k]]

    def link_down(self, k: int) -> None:
        """Cut node k's link (`ip link set eth0 down` in its namespace): its packets go nowhere
        and nobody's reach it, as when a machine's uplink fails; its processes keep running."""
        _run_checked(*self.exec_prefix(k), "ip", "link", "set", "eth0", "down")

    def link_up(self, k: int) -> None:
        """Restore node k's link (its address, route and rate limit come back with it)."""
        _run_checked(*self.exec_prefix(k), "ip", "link", "set", "eth0", "up")

    def __enter__(self) -> WanBed:
        reason = bed_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        rate = f"{self.rate_mbit}mbit"
        _run_checked("ip", "netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        inb = ["ip", "netns", "exec", self.bridge_ns]
        _run_checked(*inb, "ip", "link", "add", "br0", "type", "bridge")
        _run_checked(*inb, "ip", "link", "set", "br0", "up")
        for k, ns in enumerate(self.node_ns):
            _run_checked("ip", "netns", "add", ns)
            self._made.append(ns)
            inn = ["ip", "netns", "exec", ns]
            _run_checked(
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                f"b{k}",
                "netns",
                self.bridge_ns,
            )
            _run_checked(*inn, "ip", "addr", "add", f"{self.ip(k)}/24", "dev", "eth0")
            _run_checked(*inn, "ip", "link", "set", "lo", "up")
            _run_checked(*inn, "ip", "link", "set", "eth0", "up")
            _run_checked(*inb, "ip", "link", "set", f"b{k}", "master", "br0")
            _run_checked(*inb, "ip", "link", "set", f"b{k}", "up")
            # egress of the node (upload) and egress of the bridge port (download)
            for where, dev in ((inn, "eth0"), (inb, f"b{k}")):
                _run_checked(
                    *where,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    self.burst,
                    "latency",
                    "100ms",
                )

    def pids(self, k: int | None = None) -> list[int]:
        """Processes living in node k's namespace (every namespace of the bed when None)."""
        names = self._made if k is None else [self.node_ns[k]]
        out: list[int] = []
        for ns in names:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            out += [int(p) for p in r.stdout.split() if p.isdigit()]
        return out

    def namespaces_left(self) -> list[str]:
        """This bed's namespaces that still exist (empty once closed)."""
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
        return [line.split()[0] for line in r.stdout.splitlines() if self.tag in line]

    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every process in the bed's namespaces and wait until none is left:
        deleting a namespace does not end the processes in it."""
        deadline = time.monotonic() + timeout
        while pids := self.pids():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)  # a stopped process must run to die
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} outlived SIGKILL in the bed's namespaces")
            time.sleep(0.1)

    def close(self) -> None:
        try:
            self.kill_all()
        finally:
            for ns in reversed(self._made):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            self._made.clear()

    def __exit__(self, *exc) -> None:
        self.close()
