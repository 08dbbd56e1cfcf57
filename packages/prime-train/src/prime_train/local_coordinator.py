"""The local launcher's coordinator: `prime-mesh coordinator` as its own process, restarted if
it dies, on one port for the whole run.

As on real machines the coordinator is a process of its own, so losing it can be tried on one
machine (`kill` it): the launcher starts the same command again on the same port, and the
nodes, which kept training, re-form the run with it at their next outer step.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prime_train.lifetime import die_with_parent

_START_TIMEOUT = 60.0  # seconds for a (re)started coordinator to answer


class CoordinatorProcess:
    """`prime-mesh coordinator` on 127.0.0.1:`port`, kept running until `close()`."""

    def __init__(self, nodes: int, port: int, status_port: int | None = None) -> None:
        self.address = f"127.0.0.1:{port}"
        self.restarts = 0
        self._args = [
            sys.executable, "-m", "prime_mesh.cli", "coordinator",
            "--host", "127.0.0.1", "--port", str(port), "--min-nodes", str(nodes),
        ]  # fmt: skip
        if status_port is not None:
            self._args += ["--status-port", str(status_port)]
        self._stopping = threading.Event()
        self._proc = self._start()
        self._supervisor = threading.Thread(target=self._watch, name="coordinator", daemon=True)
        self._supervisor.start()

    def status(self) -> dict:
        """The coordinator's view (`prime_mesh.query_status`); no nodes while it restarts."""
        from prime_mesh import MeshError, query_status

        try:
            return query_status(self.address, timeout=5.0)
        except (MeshError, OSError, TimeoutError):
            return {"epoch": 0, "nodes": []}

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            self._args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        threading.Thread(target=_pump, args=(proc.stdout,), daemon=True).start()
        deadline = time.monotonic() + _START_TIMEOUT
        host, port = self.address.rsplit(":", 1)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
                return proc
            except OSError:
                time.sleep(0.1)
        code = proc.poll()
        if code is None:
            proc.kill()
            proc.wait(timeout=10)
        from prime_mesh import MeshError

        raise MeshError(
            f"the coordinator did not start on {self.address} (exit code {proc.returncode}); "
            "see its [coordinator] lines above"
        )

    def _watch(self) -> None:
        while not self._stopping.is_set():
            if self._proc.poll() is not None and not self._stopping.is_set():
                code = self._proc.returncode
                print(
                    f"[launch] the coordinator exited (code {code}); restarting it on "
                    f"{self.address}: the nodes re-form the run at their next outer step",
                    file=sys.stderr,
                    flush=True,
                )
                try:
                    self._proc = self._start()
                    self.restarts += 1
                except Exception as e:  # the nodes report CoordinatorGone after their grace
                    print(f"[launch] {e}", file=sys.stderr, flush=True)
                    return
            self._stopping.wait(0.2)

    def close(self) -> None:
        self._stopping.set()
        self._supervisor.join(timeout=5)
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)


def _pump(stream) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        if line.startswith("prime-mesh status page at "):  # as the launcher has always said it
            line = "[launch] status page at " + line.rsplit(" ", 1)[1]
        else:
            line = f"[coordinator] {line}"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    stream.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_coordinator(nodes: int, status_port: int | None = None) -> Iterator[CoordinatorProcess]:
    """A coordinator process for `nodes` local nodes on a free port kept for the whole run
    (has .address, .status()); the token comes from PRIME_TOKEN in this environment."""
    if not os.environ.get("PRIME_TOKEN"):
        raise RuntimeError("set PRIME_TOKEN before starting the local coordinator")
    coordinator = CoordinatorProcess(nodes, _free_port(), status_port)
    try:
        yield coordinator
    finally:
        coordinator.close()
