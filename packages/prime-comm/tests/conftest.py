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
        port = free_port()
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

    def run(
        self, case: str, world: int, group: str | None = None, timeout: float = 120.0, **args
    ) -> list[dict]:
        """Run `case` on ranks 0..world-1 in `group` (default: the world-size group)."""
        group = group or f"w{world}"
        for rank in range(world):
            cmd = {"case": case, "world": world, "group": group, "args": args}
            self.procs[rank].stdin.write(json.dumps(cmd) + "\n")
            self.procs[rank].stdin.flush()
        out = [self._reply(rank, timeout) for rank in range(world)]
        for rank, r in enumerate(out):
            assert r["ok"], f"rank {rank} failed in {case}: {r['error']}\n{r['traceback']}"
        return out

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


@pytest.fixture(scope="module")
def pool4():
    pool = RankPool(4)
    try:
        yield pool
    finally:
        pool.close()
