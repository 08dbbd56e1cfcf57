"""How long does building one epoch's gloo group take at N nodes, on this machine?

Each of N processes (a node, one local rank) connects to one TCPStore (as the coordinator's)
and builds the group the way prime-mesh does (`prime_mesh.epoch.build_group`: a fresh
prefix per epoch, a full mesh of N*(N-1)/2 TCP connections), then all-reduces one float on
it. Timed on every rank from the moment all N are ready to build; the figure is the slowest
rank's, the median over --epochs rebuilds. The baseline in the same run is the all-reduce
of one float on the group just built (what the group costs once it exists).

    uv run python benchmarks/gloo_group.py [--nodes 2 4 8 16] [--epochs 3]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import secrets
import statistics
import time


def node(rank: int, n: int, port: int, epochs: list[str], out) -> None:
    import torch
    import torch.distributed as dist

    from prime_mesh.epoch import Epoch, build_group

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    members = tuple(f"n{i}" for i in range(n))
    for number, prefix in enumerate(epochs, 1):
        store.add(f"ready/{number}", 1)
        while int(store.add(f"ready/{number}", 0)) < n:  # every node ready: the build starts
            time.sleep(0.001)
        t0 = time.perf_counter()
        pg = build_group(store, Epoch(number, prefix, members), f"n{rank}", 0, "127.0.0.1", 60)
        built = time.perf_counter() - t0
        t1 = time.perf_counter()
        pg.allreduce([torch.ones(1)]).wait()
        first = time.perf_counter() - t1
        t2 = time.perf_counter()
        pg.allreduce([torch.ones(1)]).wait()
        out.put((number, rank, built, first, time.perf_counter() - t2))
        store.add(f"done/{number}", 1)
        while int(store.add(f"done/{number}", 0)) < n:
            time.sleep(0.001)
        del pg


def measure(n: int, epochs: int) -> dict:
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    prefixes = [secrets.token_hex(8) for _ in range(epochs)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=node, args=(r, n, master.port, prefixes, out)) for r in range(n)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=300) for _ in range(n * epochs)]
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    per_epoch = [[r for r in rows if r[0] == e] for e in range(1, epochs + 1)]
    build = statistics.median(max(r[2] for r in rs) for rs in per_epoch)
    first = statistics.median(max(r[3] for r in rs) for rs in per_epoch)
    steady = statistics.median(max(r[4] for r in rs) for rs in per_epoch)
    return {"nodes": n, "build_s": build, "first_s": first, "allreduce_s": steady}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    print(
        "| nodes | build the group (s) | first all-reduce (ms) | all-reduce of 1 float (ms) | build / all-reduce |"
    )
    print("| --- | --- | --- | --- | --- |")
    for n in args.nodes:
        r = measure(n, args.epochs)
        ratio = r["build_s"] / r["allreduce_s"]
        print(
            f"| {n} | {r['build_s']:.3f} | {1e3 * r['first_s']:.1f} | "
            f"{1e3 * r['allreduce_s']:.2f} | {ratio:.0f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
