"""A pool of rank processes for the all-reduce tests (see comm_worker.py)."""

from __future__ import annotations

import json
import queue
import tempfile
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from prime_testkit import Children, free_port

WORKER = Path(__file__).with_name("comm_worker.py")


class RankPool:
    """SIZE worker processes in one gloo world; `run` sends a case to ranks 0..world-1."""

    def __init__(self, size: int, start_timeout: float = 120.0) -> None:
        self.size = size
        self.children = Children()
        self.port = port = free_port()
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        self.procs, self.replies, self.logs = [], [], []
        for rank in range(size):
            log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
            p = self.children.python(
                [str(WORKER), str(rank), str(size), str(port)],
                stdin=-1,
                stdout=-1,
                stderr=log,
                text=True,
                bufsize=1,
            )
            q: queue.Queue = queue.Queue()
            threading.Thread(target=_pump, args=(p.stdout, q), daemon=True).start()
            self.procs.append(p)
            self.replies.append(q)
            self.logs.append(log)
        for rank in range(size):
            assert self._reply(rank, start_timeout).get("ready") == rank
        self.fresh = 0

    def fresh_group(self) -> str:
        self.fresh += 1
        return f"fresh{self.fresh}"

    def send(self, rank: int, case: str, world: int, group: str | None = None, **args) -> None:
        """Start `case` on one rank (collect its answer with `reply`)."""
        cmd = {"case": case, "world": world, "group": group or f"w{world}", "args": args}
        self.procs[rank].stdin.write(json.dumps(cmd) + "\n")
        self.procs[rank].stdin.flush()

    def reply(self, rank: int, timeout: float = 120.0) -> dict:
        r = self._reply(rank, timeout)
        assert r["ok"], f"rank {rank} failed: {r['error']}\n{r['traceback']}"
        return r

    def run(
        self, case: str, world: int, group: str | None = None, timeout: float = 120.0, **args
    ) -> list[dict]:
        """Run `case` on ranks 0..world-1 in `group` (default: the world-size group)."""
        for rank in range(world):
            self.send(rank, case, world, group, **args)
        return [self.reply(rank, timeout) for rank in range(world)]

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()
        self.procs[rank].wait(timeout=30)

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


def _pump(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


@pytest.fixture(scope="session")
def pool4():
    """Four rank processes shared by the all-reduce and abort modules (startup dominates)."""
    pool = RankPool(4)
    try:
        yield pool
    finally:
        pool.close()
