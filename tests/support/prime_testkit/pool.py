"""A session-long pool of rank processes in one gloo world, for tests that need a healthy
multi-rank group but not fresh processes (starting torch in a process dominates such tests).

    pool = RankPool(4)
    replies = pool.run(my_case, 2, n=1000)   # my_case(ctx, n=1000) on ranks 0 and 1

A case is a module-level function `case(ctx: RankContext, **args) -> dict | None` in a test
file or a helper file (the worker loads that file by path); args and the returned dict are
JSON. `ctx.pg` is the group the call runs in: by default the subgroup of ranks 0..world-1
(registered with torch.distributed, so `dist.*(group=ctx.pg)` works), or a fresh unregistered
gloo group named by `fresh_group()` for cases that may leave their group unusable (aborts).
Each rank process is `python -m prime_testkit.worker`; see worker.py.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from prime_testkit.children import Children, free_port

SUPPORT = Path(__file__).resolve().parent.parent  # tests/support, where prime_testkit lives
Case = Callable[..., Any] | tuple[str | Path, str]


def case_spec(case: Case) -> list[str]:
    """[module name, file, function name] of a case: a function, or (file, function name)."""
    if isinstance(case, tuple):
        path, name = case
        return [Path(path).stem, str(path), name]
    return [case.__module__, inspect.getfile(case), case.__qualname__]


class RankPool:
    """`size` rank processes in one gloo world; `run` sends a case to ranks 0..world-1."""

    def __init__(self, size: int, start_timeout: float = 120.0, threads: int = 1) -> None:
        self.size = size
        self.children = Children()
        self.port = port = free_port()
        # The pool hosts the store, so that bare peers (`python -m prime_testkit.worker join
        # ...`) can join fresh groups in it too.
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), *_pythonpath()]))
        self.procs, self.replies, self.logs = [], [], []
        for rank in range(size):
            log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
            args = ["-m", "prime_testkit.worker", str(rank), str(size), str(port), str(threads)]
            p = self.children.python(
                args, stdin=-1, stdout=-1, stderr=log, text=True, bufsize=1, env=env
            )
            q: queue.Queue = queue.Queue()
            threading.Thread(target=_pump, args=(p.stdout, q), daemon=True).start()
            self.procs.append(p)
            self.replies.append(q)
            self.logs.append(log)
        self._ids = [0] * size
        for rank in range(size):
            assert self._reply(rank, start_timeout).get("ready") == rank
        self.fresh = 0

    def fresh_group(self) -> str:
        """A new group name: the ranks of the next call build a fresh gloo group under it."""
        self.fresh += 1
        return f"fresh{self.fresh}"

    def send(self, rank: int, case: Case, world: int, group: str | None = None, **args) -> None:
        """Start `case` on one rank (collect its answer with `reply`)."""
        self._ids[rank] += 1
        cmd = {
            "id": self._ids[rank],
            "case": case_spec(case),
            "world": world,
            "group": group or f"w{world}",
            "args": args,
        }
        self.procs[rank].stdin.write(json.dumps(cmd) + "\n")
        self.procs[rank].stdin.flush()

    def reply(self, rank: int, timeout: float = 120.0) -> dict:
        """The answer to the last `send` to `rank`; AssertionError with its traceback if the
        case raised, or with the rank's log if it gave none within `timeout` seconds."""
        while True:  # answers to calls a failed test gave up on are stale: skip them
            r = self._reply(rank, timeout)
            if r.get("id") == self._ids[rank]:
                break
        assert r["ok"], f"rank {rank} failed: {r['error']}\n{r['traceback']}"
        return r

    def run(
        self, case: Case, world: int, group: str | None = None, timeout: float = 120.0, **args
    ) -> list[dict]:
        """Run `case` on ranks 0..world-1 in `group` (default: the subgroup of that size)."""
        for rank in range(world):
            self.send(rank, case, world, group, **args)
        return [self.reply(rank, timeout) for rank in range(world)]

    def cases(self, path: str | Path, prefix: str = "case_") -> CaseFile:
        """This pool, running cases by short name from one file ("reduce" -> case_reduce)."""
        return CaseFile(self, Path(path), prefix)

    def bare_peer(self, children: Children, rank: int, world: int, group: str):
        """Start a separate process that joins fresh `group` as `rank` and idles (a peer for a
        test to kill); returns its Popen once it has joined."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), *_pythonpath()]))
        args = ["-m", "prime_testkit.worker", "join", str(rank), str(world), str(self.port)]
        p = children.python([*args, group], stdout=-1, text=True, env=env)
        line = p.stdout.readline().strip()
        assert line == "joined", f"bare peer did not join {group}: {line!r}"
        return p

    def _reply(self, rank: int, timeout: float) -> dict:
        try:
            line = self.replies[rank].get(timeout=timeout)
        except queue.Empty:
            msg = f"rank {rank} gave no reply in {timeout}s\n{self.log(rank)}"
            raise AssertionError(msg) from None
        if line is None:
            raise AssertionError(f"rank {rank} exited\n{self.log(rank)}")
        return json.loads(line)

    def log(self, rank: int) -> str:
        """The end of a rank's stderr (its stray prints and tracebacks)."""
        self.logs[rank].seek(0)
        return self.logs[rank].read()[-4000:]

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"quit": True}) + "\n")
                p.stdin.close()
            except OSError:
                pass
        self.children.kill_all()
        for log in self.logs:
            log.close()


class CaseFile:
    """A RankPool view whose cases are named functions of one file (`pool.cases(path)`)."""

    def __init__(self, pool: RankPool, path: Path, prefix: str) -> None:
        self.pool, self.path, self.prefix = pool, path, prefix

    def _case(self, name: str) -> tuple[Path, str]:
        return (self.path, self.prefix + name)

    def run(self, name: str, world: int, group: str | None = None, **kw: Any) -> list[dict]:
        return self.pool.run(self._case(name), world, group, **kw)

    def send(self, rank: int, name: str, world: int, group: str | None = None, **kw) -> None:
        self.pool.send(rank, self._case(name), world, group, **kw)

    def reply(self, rank: int, timeout: float = 120.0) -> dict:
        return self.pool.reply(rank, timeout)

    def fresh_group(self) -> str:
        return self.pool.fresh_group()

    def bare_peer(self, children: Children, rank: int, world: int, group: str):
        return self.pool.bare_peer(children, rank, world, group)


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _pump(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)
