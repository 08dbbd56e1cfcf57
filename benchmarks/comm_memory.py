"""Peak memory of prime_comm's all-reduce per parameter, two gloo ranks on 127.0.0.1.

    uv run python benchmarks/comm_memory.py [--numel 100000000] [--compression uint8]

Each rank allocates a float32 tensor of `--numel` elements (and, with `--residual`, its
error-feedback residual), resets its peak RSS (/proc/self/clear_refs), runs one all_reduce,
and reports how far the peak (VmHWM) rose above the resident size before the call, in bytes
per element: what the collective itself costs on top of the tensors it was given. The
baseline in the same run is a gloo float32 all_reduce of the same tensor (torch's own,
in place), measured the same way.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_above(fn) -> int:
    """Bytes the peak RSS rose above the RSS before `fn()`."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    import prime_comm

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2
    )
    torch.set_num_threads(1)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.rank))
    res = torch.zeros_like(x) if args.residual else None
    small = torch.ones(1 << 16)
    prime_comm.all_reduce(small, compression=args.compression)  # warm-up: buffers, kernels
    dist.all_reduce(small)
    base = peak_above(lambda: dist.all_reduce(x))
    ours = peak_above(lambda: prime_comm.all_reduce(x, compression=args.compression,
                                                    residual=res))  # fmt: skip
    if args.rank == 0:
        n = args.numel
        print(f"{n / 1e6:.0f}M float32 per rank, 2 gloo ranks, {args.compression}"
              f"{' + residual' if args.residual else ''}: peak above the call's start "
              f"gloo fp32 {base / n:.2f} B/elem, prime_comm {ours / n:.2f} B/elem "
              f"({ours / 1e6:.0f} MB)")  # fmt: skip
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--compression", default="uint8")
    ap.add_argument("--residual", action="store_true")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--numel", str(args.numel), "--compression",
            args.compression, "--port", str(port)] + (["--residual"] if args.residual else [])  # fmt: skip
    procs = [subprocess.Popen([*argv, "--rank", str(r)], env=dict(os.environ)) for r in (0, 1)]
    codes = [p.wait(timeout=600) for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
