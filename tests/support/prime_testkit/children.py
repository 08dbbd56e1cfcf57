"""Child processes that never outlive a test, free ports, and bounded waits.

Children are started in their own process group with PR_SET_PDEATHSIG, so they die with the
test process even if pytest itself is killed, and `Children.kill_all()` (run by the `children`
fixture on teardown) SIGKILLs every group and reaps it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from prime_train.lifetime import die_with_parent


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _target_spec(target: Callable[..., Any]) -> tuple[str, str, str]:
    # Test modules are imported with --import-mode=importlib under names a spawned child cannot
    # import, so the child loads the target's file itself.
    return (target.__module__, inspect.getfile(target), target.__qualname__)


def load_target(spec: tuple[str, str, str]) -> Callable[..., Any]:
    module_name, path, qualname = spec
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _mp_entry(spec: tuple[str, str, str], args: tuple, kwargs: dict) -> None:
    die_with_parent()
    load_target(spec)(*args, **kwargs)


class Children:
    """Starts child processes and guarantees they are killed and reaped."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen] = []
        self.procs: list[mp.process.BaseProcess] = []
        self._ctx = mp.get_context("spawn")

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen in a new process group that dies with this process."""
        p = subprocess.Popen(list(args), preexec_fn=die_with_parent, **kwargs)
        self.popens.append(p)
        return p

    def python(self, code_or_args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Run `python ARGS...` with this interpreter."""
        return self.popen([sys.executable, *code_or_args], **kwargs)

    def process(self, target: Callable[..., Any], *args: Any, **kwargs: Any):
        """Start `target(*args, **kwargs)` in a spawned multiprocessing child.

        `target` may be a function defined in a test file: the child imports it by file path.
        """
        spec = _target_spec(target)
        p = self._ctx.Process(target=_mp_entry, args=(spec, args, kwargs), daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def ranks(self, worker: Callable[..., Any], world: int, *args: Any, timeout: float = 100):
        """Run `worker(rank, world, port, *args, queue)` in `world` spawned children that meet
        at a free port (a gloo world, `gloo_world`); each puts one `(rank, result)` on the
        queue. Returns {rank: result}, waiting at most `timeout` seconds for each."""
        port, q = free_port(), self.queue()
        for r in range(world):
            self.process(worker, r, world, port, *args, q)
        return dict(q.get(timeout=timeout) for _ in range(world))

    def queue(self):
        """A spawn-context queue. Send plain data or numpy arrays, not tensors: torch shares a
        tensor's storage by file descriptor, which is gone once the sending child exits."""
        return self._ctx.Queue()

    def kill_all(self) -> None:
        for pid in [p.pid for p in self.popens] + [p.pid for p in self.procs]:
            if pid is None:
                continue
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.popens:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            p.join(timeout=10)
        self.popens.clear()
        self.procs.clear()


def wait_until(
    predicate: Callable[[], bool], timeout: float, interval: float = 0.05, what: str = "condition"
) -> None:
    """Poll `predicate` until true; raise TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def wait_exit(p: subprocess.Popen, timeout: float, log: str | os.PathLike | None = None) -> int:
    """`p`'s exit code, waited for `timeout` seconds at most. Past it, every prime-train
    process of its tree prints its threads' stacks (SIGUSR1), and AssertionError carries the
    log's tail with them: a test that hangs says where."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    alive = []
    for pid in descendants(p.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        alive.append(f"{pid}: {cmd[:160]}")
        if "prime_train.cli" in cmd:  # (its handler prints and goes on; not to other programs)
            os.kill(pid, signal.SIGUSR1)
    time.sleep(3)  # (the stacks reach the log through the launcher's pipes)
    tail = ""
    if log is not None:
        with open(log, errors="replace") as f:
            tail = f.read()[-12000:]
    raise AssertionError(
        f"pid {p.pid} still running {timeout:.0f} s later; its processes:\n"
        + "\n".join(alive)
        + f"\n--- log tail (with their stacks) ---\n{tail}"
    )
