"""One rank of a RankPool (see pool.py), or a bare peer that joins one fresh group and idles.

    python -m prime_testkit.worker RANK SIZE STORE_PORT THREADS
    python -m prime_testkit.worker join RANK WORLD STORE_PORT GROUP

A rank joins the pool's gloo world of SIZE ranks (the store is the pool's), makes the
subgroup of ranks 0..w-1 for every w < SIZE, and then runs the cases sent as JSON lines on
stdin, answering one JSON line each on the original stdout (stray prints go to stderr).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from prime_testkit.children import load_target
from prime_testkit.gloo import DEFAULT_TIMEOUT, gloo_group, gloo_world

TIMEOUT = timedelta(seconds=DEFAULT_TIMEOUT)


@dataclass
class RankContext:
    """What a case gets: this rank, the call's world size and group, and the pool's store."""

    rank: int
    world: int
    pg: Any
    group: str
    store: dist.Store


class Worker:
    def __init__(self, rank: int, size: int, port: int) -> None:
        self.rank, self.size = rank, size
        self.store = gloo_world(rank, size, port, host_store=False)
        self.groups: dict[str, Any] = {f"w{size}": dist.group.WORLD}
        for w in range(1, size):
            g = dist.new_group(list(range(w)), backend="gloo", timeout=TIMEOUT)
            if rank < w:
                self.groups[f"w{w}"] = g

    def group(self, name: str, world: int):
        if name not in self.groups:  # a fresh group of ranks 0..world-1 under its own prefix
            self.groups[name] = gloo_group(self.store, name, self.rank, world)
        return self.groups[name]

    def call(self, cmd: dict) -> dict:
        pg = self.group(cmd["group"], cmd["world"])
        ctx = RankContext(self.rank, cmd["world"], pg, cmd["group"], self.store)
        fn = load_target(tuple(cmd["case"]))
        return {"ok": True, **(fn(ctx, **cmd.get("args", {})) or {})}


def serve(rank: int, size: int, port: int, threads: int) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, the protocol keeps stdout
    torch.set_num_threads(threads)
    worker = Worker(rank, size, port)
    out.write(json.dumps({"ready": rank}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        try:
            reply = worker.call(cmd)
        except Exception as e:
            reply = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        out.write(json.dumps({"id": cmd.get("id"), **reply}) + "\n")


def join(rank: int, world: int, port: int, group: str) -> None:
    """Join fresh `group` as `rank` and stay idle until killed (a peer to kill in tests)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    gloo_group(store, group, rank, world)
    print("joined", flush=True)
    time.sleep(600)


def main() -> None:
    if sys.argv[1] == "join":
        join(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        serve(*(int(a) for a in sys.argv[1:5]))


if __name__ == "__main__":
    main()
