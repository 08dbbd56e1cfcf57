"""prime-comm all_reduce (uint8) against gloo's float32 dist.all_reduce, same run, same data.

    uv run python benchmarks/comm_allreduce.py                       # loopback, W = 2..4
    uv run python benchmarks/comm_allreduce.py --wan 100 --sizes 1M 4M   # root: tbf-limited bed
    uv run python benchmarks/comm_allreduce.py --compression uint2 --residual  # error feedback

`--compression uint4|uint2` times that width instead of uint8; `--residual` passes a residual
buffer (error feedback: `all_reduce(..., residual=)`), to price its extra decode pass.

For each world size and tensor size (standard-normal data, op="avg") it reports the slowest
rank's seconds (median of --repeats), the bytes each rank really wrote to its sockets
(/proc/self/io wchar, averaged over ranks), and the relative L2 error of the uint8 result
against float32 dist.all_reduce. --wan N runs every rank in its own network namespace with
N Mbit/s links (tests/support/prime_netbed.py); loopback has no bandwidth limit, so there
the time is mostly compute. On the bed it adds the link utilisation of each: the bytes a rank
wrote over (link rate x seconds), and the ideal fp32 ring time 2(W-1)/W x 4n bytes / rate
(the README's figure: `--wan 100 --worlds 4 --sizes 25000000`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import prime_comm

    torch.set_num_threads(args.threads)
    prime_comm.set_num_threads(args.threads)
    from prime_testkit import gloo_world

    host, port = args.master.rsplit(":", 1)
    gloo_world(args.rank, args.world, int(port), host=host, timeout=600.0)
    for n in args.sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(1000 + args.rank))
        exact = x.clone()
        dist.all_reduce(exact)
        exact /= args.world
        rows = {"fp32": [], "q": []}
        res = torch.zeros(n) if args.residual else None
        for _ in range(args.repeats):
            for kind in ("fp32", "q"):
                y = x.clone()
                dist.barrier()
                w0, t0 = wchar(), time.perf_counter()
                if kind == "fp32":
                    dist.all_reduce(y)
                    y /= args.world
                else:
                    prime_comm.all_reduce(
                        y, op="avg", timeout=600, compression=args.compression, residual=res
                    )
                seconds = time.perf_counter() - t0
                written = wchar() - w0
                slowest = torch.tensor([seconds])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                rows[kind].append((slowest.item(), written))
                if kind == "q":
                    err = ((y - exact).norm() / exact.norm()).item()
        out = {
            "rank": args.rank,
            "n": n,
            "fp32_s": statistics.median(r[0] for r in rows["fp32"]),
            "q_s": statistics.median(r[0] for r in rows["q"]),
            "fp32_bytes": statistics.median(r[1] for r in rows["fp32"]),
            "q_bytes": statistics.median(r[1] for r in rows["q"]),
            "err": err,
        }
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def run_world(args: argparse.Namespace, world: int, bed) -> list[dict]:
    """Start `world` ranks (inside the bed's namespaces if any) and collect their rows."""
    from prime_testkit import Children, free_port

    host = bed.ip(0) if bed else "127.0.0.1"
    port = free_port() if not bed else 29500 + world
    # (TORCH_CPP_LOG_LEVEL: a namespace has no hostname to resolve, which c10d warns about.)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0" if bed else "lo", TORCH_CPP_LOG_LEVEL="ERROR")
    children = Children()
    try:
        procs = []
        for rank in range(world):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--master",
                f"{host}:{port}",
                "--threads",
                str(args.threads),
                "--repeats",
                str(args.repeats),
                "--compression",
                args.compression,
                *(["--residual"] if args.residual else []),
                "--sizes",
                *map(str, args.sizes),
            ]
            prefix = bed.exec_prefix(rank) if bed else []
            procs.append(children.popen(prefix + cmd, stdout=subprocess.PIPE, text=True, env=env))
        rows: list[dict] = []
        for line in procs[0].stdout:
            row = json.loads(line)
            rows.append(row)
            report(world, row, label(args))
        per_rank = [rows] + [[json.loads(line) for line in p.stdout] for p in procs[1:]]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise SystemExit(f"a rank of the W={world} run failed (exit {p.returncode})")
        for i, row in enumerate(rows):  # bytes: average over ranks
            for key in ("fp32_bytes", "q_bytes"):
                row[key] = statistics.mean(r[i][key] for r in per_rank)
        return rows
    finally:
        children.kill_all()


def label(args: argparse.Namespace) -> str:
    return args.compression + ("+residual" if args.residual else "")


def report(world: int, r: dict, q: str) -> None:
    print(
        f"  W={world} n={r['n']:>11,}: fp32 {r['fp32_s']:8.3f} s  {q} {r['q_s']:8.3f} s  "
        f"(time x{r['q_s'] / r['fp32_s']:.2f})  error {r['err']:.3%}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--sizes", nargs="+", default=["1M", "4M", "16M", "64M"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="kernel and torch threads per rank")
    ap.add_argument("--wan", type=float, default=None, help="link rate in Mbit/s (root)")
    ap.add_argument("--compression", choices=["uint8", "uint4", "uint2"], default="uint8")
    ap.add_argument("--residual", action="store_true", help="pass residual= (error feedback)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = [parse_size(str(s)) for s in args.sizes]
    sys.path.insert(0, str(ROOT / "tests" / "support"))  # prime_testkit, prime_netbed
    if args.worker:
        worker(args)
        return
    where = f"WAN bed, {args.wan:g} Mbit/s links" if args.wan else "loopback"
    print(
        f"all_reduce avg, standard normal, {where}, {args.threads} thread(s) per rank, "
        f"median of {args.repeats}"
    )
    results = []
    for world in args.worlds:
        if args.wan:
            from prime_netbed import WanBed

            with WanBed(world, rate_mbit=args.wan) as bed:
                results.append((world, run_world(args, world, bed)))
        else:
            results.append((world, run_world(args, world, None)))
    q = label(args)
    print(
        f"\n| W | elements | fp32 s | {q} s | time ratio | fp32 bytes/rank | "
        f"{q} bytes/rank | bytes ratio | {q} error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world, rows in results:
        for r in rows:
            print(
                f"| {world} | {r['n']:,} | {r['fp32_s']:.3f} | {r['q_s']:.3f} | "
                f"{r['q_s'] / r['fp32_s']:.2f} | {r['fp32_bytes']:,.0f} | "
                f"{r['q_bytes']:,.0f} | {r['q_bytes'] / r['fp32_bytes']:.3f} | "
                f"{r['err']:.3%} |"
            )
    if args.wan:
        print_utilisation(results, args.wan, q)


def print_utilisation(results: list[tuple[int, list[dict]]], mbit: float, q: str) -> None:
    """Link utilisation: bytes each rank wrote / (rate x seconds), and the ideal ring time."""
    rate = mbit * 1e6 / 8  # bytes per second, each direction
    print(f"\nlink utilisation at {mbit:g} Mbit/s (ideal fp32 ring: 2(W-1)/W x 4n bytes / rate)")
    print("| W | elements | ideal fp32 s | fp32 s | fp32 of ideal | fp32 link use | "
          f"{q} s | {q} link use | {q} vs ideal fp32 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for world, rows in results:
        for r in rows:
            ideal = 2 * (world - 1) / world * 4 * r["n"] / rate
            print(
                f"| {world} | {r['n']:,} | {ideal:.2f} | {r['fp32_s']:.2f} | "
                f"{ideal / r['fp32_s']:.2f} | {r['fp32_bytes'] / (rate * r['fp32_s']):.2f} | "
                f"{r['q_s']:.2f} | {r['q_bytes'] / (rate * r['q_s']):.2f} | "
                f"{ideal / r['q_s']:.2f}x faster |"
            )


if __name__ == "__main__":
    main()
