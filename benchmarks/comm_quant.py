"""prime-comm kernels: quantize / dequantize element rates against float32 copy_.

    uv run python benchmarks/comm_quant.py [--numel 16777216] [--runs 9] [--threads 1 2]
                                           [--bits 8 4 2]

Each figure is an element rate divided by torch's float32 `copy_` rate on the same buffer
(the memory limit), measured in the same process. Every run times all the calls in turn
(copy_, quantize with `out=`, `quantize(x)`, dequantize with `out=`, `dequantize(q)`,
dequantize_add_), so a load spike on this shared machine hits a run's calls alike; a run's
ratio is copy_'s time over the call's time in that run, and the table shows the median over
the runs with the lowest and highest run (the best run is the highest ratio), one row per
code width (`--bits`, default 8, 4 and 2) and thread count. The allocating forms include allocating and
freeing their result, as a caller pays it. One thread is timed in thread CPU time (its own
page faults included, other processes' load not); more threads in wall time. At the end,
the speed-up over the pure-torch reference (prime_comm.reference, the tests' yardstick).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import prime_comm
from prime_comm import _kernels
from prime_comm.reference import dequantize_ref, quantize_ref

GOALS = {"quantize": 0.7, "dequantize": 1.0}  # x copy_, one thread, both forms, every width


def timed_runs(fns: dict, runs: int, clock) -> dict[str, list[float]]:
    """Seconds of each function in each run; the functions take turns within a run."""
    for fn in fns.values():
        fn()  # warm up: page faults of preallocated buffers, thread start
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t = clock()
            fn()
            times[name].append(clock() - t)
    return times


def measure(x: torch.Tensor, threads: int, runs: int, bits: int) -> dict[str, list[float]]:
    """Per-run ratios (x copy_) of every call at this thread count and code width."""
    torch.set_num_threads(threads)
    prime_comm.set_num_threads(threads)
    dst = torch.empty_like(x)
    acc = torch.zeros_like(x)
    buf = torch.empty(prime_comm.encoded_nbytes(x.numel(), bits), dtype=torch.uint8)
    q = prime_comm.quantize(x, out=buf, bits=bits)
    fns = {
        "copy_": lambda: dst.copy_(x),
        "quantize out=": lambda: prime_comm.quantize(x, out=buf, bits=bits),
        # the result is freed at once, as callers do
        "quantize(x)": lambda: prime_comm.quantize(x, bits=bits),
        "dequantize out=": lambda: prime_comm.dequantize(q, out=dst),
        "dequantize(q)": lambda: prime_comm.dequantize(q),
        "dequantize_add_": lambda: prime_comm.dequantize_add_(acc, q),
    }
    # One thread runs in the calling thread (torch's and ours), so its CPU time is exact and
    # immune to other processes on a shared machine; more threads need the wall clock.
    clock = time.thread_time if threads == 1 else time.perf_counter
    times = timed_runs(fns, runs, clock)
    base = times.pop("copy_")
    ratios = {name: [c / t for c, t in zip(base, ts, strict=True)] for name, ts in times.items()}
    ratios["copy_ Gelem/s"] = [x.numel() / c / 1e9 for c in base]
    return ratios


def reference_speedup(x: torch.Tensor, runs: int, bits: int) -> tuple[float, float]:
    """Median speed-up of the kernels over the pure-torch reference, on one thread."""
    torch.set_num_threads(1)
    prime_comm.set_num_threads(1)
    q = prime_comm.quantize(x, bits=bits)
    books, codes = quantize_ref(x, bits)
    t = timed_runs(
        {
            "ref_q": lambda: quantize_ref(x, bits),
            "q": lambda: prime_comm.quantize(x, bits=bits),
            "ref_d": lambda: dequantize_ref(books, codes),
            "d": lambda: prime_comm.dequantize(q),
        },
        runs,
        time.thread_time,
    )
    med = {k: statistics.median(v) for k, v in t.items()}
    return med["ref_q"] / med["q"], med["ref_d"] / med["d"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--runs", type=int, default=9, help="runs per figure (median; >= 5)")
    ap.add_argument("--threads", type=int, nargs="*", help="thread counts (default: 1 and all)")
    ap.add_argument(
        "--bits", type=int, nargs="*", default=[8, 4, 2], choices=prime_comm.BITS,
        help="code widths to measure (default: 8 4 2)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.runs < 5:
        ap.error("--runs must be at least 5 (the figures are medians)")
    cpus = len(os.sched_getaffinity(0))
    counts = args.threads or sorted({1, cpus})
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    print(
        f"buffer: {args.numel:,} float32 ({args.numel * 4 / 2**20:.0f} MiB), {cpus} CPUs, "
        f"simd={_kernels.simd()}, torch {torch.__version__}, {args.runs} runs per figure"
    )
    for bits in args.bits:
        y = prime_comm.dequantize(prime_comm.quantize(x, bits=bits))
        err = ((y - x).norm() / x.norm()).item()
        size = prime_comm.encoded_nbytes(args.numel, bits) / (4 * args.numel)
        print(
            f"{bits} bits: round-trip relative L2 error on standard normal {err:.4%}, "
            f"encoded size {size:.4f} x float32"
        )

    rows = []
    for bits in args.bits:
        for threads in counts:
            print(f"measuring {bits} bits, {threads} thread(s)...", flush=True)
            rows.append((bits, threads, measure(x, threads, args.runs, bits)))
    names = [k for k in rows[0][2] if k != "copy_ Gelem/s"]
    print("\nx copy_: median [lowest run, highest run]")
    print(
        f"{'bits':>4} | {'threads':>7} | {'copy_ Gelem/s':>13} | "
        + " | ".join(f"{n:>19}" for n in names)
    )
    for bits, threads, r in rows:
        cells = [
            f"{statistics.median(r[n]):5.2f} [{min(r[n]):4.2f}, {max(r[n]):4.2f}]" for n in names
        ]
        copy_rate = statistics.median(r["copy_ Gelem/s"])
        print(
            f"{bits:4d} | {threads:7d} | {copy_rate:13.2f} | "
            + " | ".join(f"{c:>19}" for c in cells)
        )

    print()
    for bits in args.bits:
        ref_q, ref_d = reference_speedup(x, max(3, args.runs // 3), bits)
        print(
            f"{bits} bits vs the pure-torch reference (1 thread): quantize {ref_q:.0f}x, "
            f"dequantize {ref_d:.0f}x"
        )
    for bits in args.bits:
        one = [r for b, t, r in rows if b == bits and t == 1] or [
            r for b, _, r in rows if b == bits
        ]
        verdicts = []
        for name in names:
            goal = GOALS.get(name.split()[0].split("(")[0])
            if goal is not None and name != "dequantize_add_":
                med, best = statistics.median(one[0][name]), max(one[0][name])
                verdicts.append(
                    f"{name} {med:.2f}, best {best:.2f} ({'meets' if med >= goal else 'below'} "
                    f"{goal})"
                )
        print(f"summary, {bits} bits (1 thread, x copy_, median): " + ", ".join(verdicts))


if __name__ == "__main__":
    main()
