"""prime-comm kernels: quantize / dequantize rates against torch on the same buffer.

    uv run python benchmarks/comm_quant.py [--numel 16777216] [--repeats 7]

For 1 thread, then every thread count up to all CPUs, prints element rates of quantize,
dequantize and the fused dequantize-accumulate as fractions of torch's float32 `copy_` rate
on the same buffer (the memory limit), and as ratios to the pure-torch reference
(prime_comm.reference, the tests' yardstick). Best of `repeats` runs each, taken in turns
(copy_, quantize, dequantize, ...) since these machines are shared and noisy; the 1-thread
row is timed in thread CPU time (exact for single-threaded work), the others in wall time.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import prime_comm
from prime_comm import _kernels
from prime_comm.reference import dequantize_ref, quantize_ref


def interleaved_best(fns: dict, repeats: int, clock) -> dict[str, float]:
    """Best time of each function, run in turns so that load spikes hit all of them alike."""
    for fn in fns.values():
        fn()  # warm up: page faults, thread start
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t = clock()
            fn()
            best[name] = min(best[name], clock() - t)
    return best


def measure(x: torch.Tensor, threads: int, repeats: int, with_ref: bool) -> dict[str, float]:
    torch.set_num_threads(threads)
    prime_comm.set_num_threads(threads)
    n = x.numel()
    dst = torch.empty_like(x)
    acc = torch.zeros_like(x)
    buf = torch.empty(prime_comm.encoded_nbytes(n), dtype=torch.uint8)
    q = prime_comm.quantize(x, out=buf)
    fns = {
        "copy_": lambda: dst.copy_(x),
        "quantize": lambda: prime_comm.quantize(x, out=buf),
        "dequantize": lambda: prime_comm.dequantize(q, out=dst),
        "dequantize_add_": lambda: prime_comm.dequantize_add_(acc, q),
    }
    # One thread runs in the calling thread (torch's and ours), so its CPU time is exact and
    # immune to other processes on a shared machine; more threads need the wall clock.
    clock = time.thread_time if threads == 1 else time.perf_counter
    times = interleaved_best(fns, repeats, clock)
    if with_ref:
        books, codes = quantize_ref(x)
        refs = {
            "ref_quantize": lambda: quantize_ref(x),
            "ref_dequantize": lambda: dequantize_ref(books, codes),
        }
        times.update(interleaved_best(refs, max(1, repeats // 3), clock))
    return {name: n / t for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    y = prime_comm.dequantize(prime_comm.quantize(x))
    err = ((y - x).norm() / x.norm()).item()
    print(
        f"buffer: {args.numel:,} float32 ({args.numel * 4 / 2**20:.0f} MiB), {cpus} CPUs, "
        f"simd={_kernels.simd()}, torch {torch.__version__}"
    )
    print(f"round-trip relative L2 error on standard normal: {err:.4%}")
    bytes_ratio = prime_comm.encoded_nbytes(args.numel) / (4 * args.numel)
    print(f"encoded size: {bytes_ratio:.4f} x float32\n")

    rows = []
    counts = sorted({1, *range(2, cpus + 1)})
    for threads in counts:
        print(f"measuring {threads} thread(s)...", flush=True)
        rows.append((threads, measure(x, threads, args.repeats, with_ref=threads in (1, cpus))))

    base = rows[0][1]
    print(
        "\nthreads | copy_ Gelem/s | quantize (x copy_) | dequantize (x copy_) | "
        "dequant+add (x copy_) | quantize scaling | dequantize scaling"
    )
    for threads, r in rows:
        c = r["copy_"]
        print(
            f"{threads:7d} | {c / 1e9:13.2f} | {r['quantize'] / 1e9:6.2f} ({r['quantize'] / c:5.2f}) "
            f"    | {r['dequantize'] / 1e9:6.2f} ({r['dequantize'] / c:5.2f})      "
            f"| {r['dequantize_add_'] / 1e9:6.2f} ({r['dequantize_add_'] / c:5.2f})       "
            f"| {r['quantize'] / base['quantize']:5.2f}x           "
            f"| {r['dequantize'] / base['dequantize']:5.2f}x"
        )
    print("\nvs the pure-torch reference (same thread count):")
    for threads, r in rows:
        if "ref_quantize" in r:
            print(
                f"  {threads} thread(s): quantize {r['quantize'] / r['ref_quantize']:.1f}x, "
                f"dequantize {r['dequantize'] / r['ref_dequantize']:.1f}x faster"
            )
    one, alln = rows[0][1], rows[-1][1]
    print(
        f"\nsummary: quantize {one['quantize'] / one['copy_']:.2f} / "
        f"{alln['quantize'] / alln['copy_']:.2f} of copy_ (1 / {cpus} threads; bar 0.3, goal 0.5), "
        f"dequantize {one['dequantize'] / one['copy_']:.2f} / "
        f"{alln['dequantize'] / alln['copy_']:.2f} (bar 0.5, goal 0.8)"
    )


if __name__ == "__main__":
    main()
