"""One rank of the test pool: runs all-reduce cases sent as JSON lines on stdin.

Started by tests/conftest.py (`python comm_worker.py RANK SIZE STORE_PORT`; or
`python comm_worker.py solo RANK WORLD STORE_PORT GROUP` for a bare peer that only joins one
group and idles, for tests that kill a peer). At start it joins
a gloo world of SIZE ranks (the default group) and makes one subgroup per world size
1..SIZE-1 with dist.new_group; cases may also ask for a fresh ProcessGroupGloo under a new
store prefix, which the abort cases use because an aborted group is left unusable. Replies
are one JSON line per command on the original stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import prime_comm

PG_TIMEOUT = timedelta(seconds=60)


class Worker:
    def __init__(self, rank: int, size: int, port: int) -> None:
        self.rank, self.size = rank, size
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=PG_TIMEOUT)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("world", self.store),
            rank=rank,
            world_size=size,
            timeout=PG_TIMEOUT,
        )
        self.groups = {f"w{size}": dist.distributed_c10d._get_default_group()}
        for w in range(1, size):
            g = dist.new_group(list(range(w)), backend="gloo", timeout=PG_TIMEOUT)
            if rank < w:
                self.groups[f"w{w}"] = g

    def group(self, name: str, world: int):
        if name not in self.groups:  # a fresh group of ranks 0..world-1 under its own prefix
            store = dist.PrefixStore(name, self.store)
            self.groups[name] = dist.ProcessGroupGloo(store, self.rank, world, PG_TIMEOUT)
        return self.groups[name]

    # ---- cases ---------------------------------------------------------------------------

    def case_reduce(
        self,
        pg,
        world,
        n,
        op="avg",
        compression="uint8",
        seed=0,
        kind="normal",
        use_default=False,
        piece_size=prime_comm.allreduce.DEFAULT_PIECE,
    ):
        x = make_input(kind, n, seed, self.rank)
        exact = x.clone()
        if n:
            w = pg.allreduce([exact])
            w.wait()
            if op == "avg":
                exact /= world
        io0 = read_io()
        stats = prime_comm.all_reduce(
            x,
            group=None if use_default else pg,
            op=op,
            compression=compression,
            timeout=60.0,
            piece_size=piece_size,
        )
        io1 = read_io()
        norm = exact.norm().item()
        err = (x - exact).norm().item()
        return {
            "digest": hashlib.sha256(x.numpy().tobytes()).hexdigest(),
            "rel_err": err / norm if norm > 0 else err,
            "max_abs_err": (x - exact).abs().max().item() if n else 0.0,
            "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received,
            "fp32_ring_bytes": stats.fp32_ring_bytes,
            "seconds": stats.seconds,
            "wchar": io1["wchar"] - io0["wchar"] if io0 and io1 else None,
            "numel": stats.numel,
        }

    def case_bad(self, pg, world, bad_rank, kind, n=1000):
        x = make_input("normal", n, 1, self.rank)
        kwargs = {"op": "avg", "compression": "uint8", "timeout": 30.0}
        arg = x
        if self.rank == bad_rank:
            if kind == "nan":
                x[n // 2] = float("nan")
            elif kind == "inf":
                x[0] = float("inf")
            elif kind == "length":
                arg = x[:-1]
            elif kind == "op":
                kwargs["op"] = "sum"
            elif kind == "bad_op":
                kwargs["op"] = "max"
            elif kind == "compression":
                kwargs["compression"] = "none"
            elif kind == "dtype":
                arg = x.double()
            elif kind == "noncontig":
                arg = torch.randn(n, 2)[:, 0]
            elif kind == "device":
                arg = torch.empty(n, device="meta")
            elif kind == "timeout":
                kwargs["timeout"] = -1
            elif kind == "not_tensor":
                arg = x.tolist()
            else:
                raise ValueError(kind)
        before = arg.clone() if isinstance(arg, torch.Tensor) and arg.device.type == "cpu" else None
        try:
            prime_comm.all_reduce(arg, group=pg, **kwargs)
            out = {"raised": None}
        except Exception as e:
            out = {"raised": type(e).__name__, "message": str(e)}
        same = (before == arg) | (before.isnan() & arg.isnan()) if before is not None else None
        out["untouched"] = same is None or bool(same.all())
        # The group must still work: the refusal happened before any data moved.
        y = make_input("normal", 4096, 2, self.rank)
        prime_comm.all_reduce(y, group=pg, timeout=30.0)
        out["after"] = hashlib.sha256(y.numpy().tobytes()).hexdigest()
        return out

    def case_abort(
        self, pg, world, mode, stall_rank, n=1 << 20, after=0.5, stall=1.5, late_timeout=1.0
    ):
        """Every rank but stall_rank calls all_reduce; stall_rank sleeps, then calls late."""
        x = make_input("normal", n, 3, self.rank)
        t0 = time.monotonic()
        if self.rank == stall_rank:
            time.sleep(stall)
            kwargs = {"timeout": late_timeout}
        elif mode == "should_abort":
            kwargs = {"should_abort": lambda: time.monotonic() - t0 > after}
        elif mode == "deadline":
            kwargs = {"timeout": after}
        elif mode == "deadline_timedelta":
            kwargs = {"timeout": timedelta(seconds=after)}
        else:
            raise ValueError(mode)
        start = time.monotonic()
        try:
            prime_comm.all_reduce(x, group=pg, **kwargs)
            return {"raised": None, "elapsed": time.monotonic() - start}
        except prime_comm.CollectiveAborted as e:
            return {
                "raised": "CollectiveAborted",
                "reason": e.reason,
                "message": str(e),
                "elapsed": time.monotonic() - start,
            }

    def case_abort_midway(self, pg, world, abort_rank, n=1 << 21, calls=3):
        """All ranks start; abort_rank's should_abort turns true after `calls` polls."""
        x = make_input("normal", n, 4, self.rank)
        polls = [0]

        def should_abort() -> bool:
            polls[0] += 1
            return self.rank == abort_rank and polls[0] > calls

        start = time.monotonic()
        try:
            prime_comm.all_reduce(
                x, group=pg, timeout=3.0, should_abort=should_abort, piece_size=1 << 16
            )
            return {"raised": None, "elapsed": time.monotonic() - start}
        except prime_comm.CollectiveAborted as e:
            return {
                "raised": "CollectiveAborted",
                "reason": e.reason,
                "elapsed": time.monotonic() - start,
            }

    def case_sleep(self, pg, world, seconds):
        time.sleep(seconds)
        return {}


def make_input(kind: str, n: int, seed: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "const":
        return torch.full((n,), 0.1 * (rank + 1))
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "heavy":  # pseudo-gradient-like: mostly small, a few large
        return torch.randn(n, generator=g) ** 3
    raise ValueError(kind)


def read_io() -> dict | None:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f)}
    except OSError:
        return None


def solo(rank: int, world: int, port: int, group: str) -> None:
    """Join one fresh group as `rank` and stay idle until killed (a peer to kill in tests)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=PG_TIMEOUT)
    dist.ProcessGroupGloo(dist.PrefixStore(group, store), rank, world, PG_TIMEOUT)
    print("joined", flush=True)
    time.sleep(600)


def main() -> None:
    if sys.argv[1] == "solo":
        solo(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    rank, size, port = (int(a) for a in sys.argv[1:4])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, the protocol keeps stdout
    torch.set_num_threads(1)
    prime_comm.set_num_threads(1)
    worker = Worker(rank, size, port)
    out.write(json.dumps({"ready": rank}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        try:
            pg = worker.group(cmd["group"], cmd["world"])
            fn = getattr(worker, "case_" + cmd["case"])
            reply = {"ok": True, **fn(pg, cmd["world"], **cmd.get("args", {}))}
        except Exception as e:
            reply = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
