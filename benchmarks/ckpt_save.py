"""How long does a checkpoint stall training? prime-ckpt vs torch.save and DCP async_save.

    uv run python benchmarks/ckpt_save.py                # ~1 GiB state (the reported figure)
    uv run python benchmarks/ckpt_save.py --size-mib 64  # quick run

All figures are measured in the same run, on the same state and the same disk folder:
- blocking time of `CheckpointManager.save()` (median of saves 3..10, each started after the
  previous one is durable) as a ratio of `torch.save` + fsync (bar 0.1x, goal 0.05x); the
  first save (buffers allocated, pages faulted in) is reported separately;
- the same for `torch.distributed.checkpoint.async_save` (what a user would pick instead);
- staging rate (bytes / blocking time) vs a torch `copy_` of the same bytes into RAM;
- time until durable on disk (save() until wait() returns);
- with --peer: peer-transfer throughput on loopback vs a raw socket copy of the same bytes,
  1 and several connections (benchmarks/ckpt_peer.py, which also runs on its own);
- with --s3: upload time of one committed checkpoint to a local moto S3 server (via s3fs) vs
  a plain s3fs `put_file` of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch


def make_state(total_bytes: int, n_tensors: int = 64) -> dict:
    per = max(1, total_bytes // n_tensors // 4)
    model = {f"layer{i}.weight": torch.randn(per) for i in range(n_tensors // 2)}
    optim = {
        i: {"exp_avg": torch.randn(per), "step": torch.tensor(10.0)} for i in range(n_tensors // 2)
    }
    return {"model": model, "optim": {"state": optim}, "progress": {"step": 10, "tokens": 12345}}


def nbytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    return 0


def tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from tensors(v)


def torch_save_fsync(state, path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def copy_rate(state) -> float:
    """Seconds for torch copy_ of every tensor into preallocated RAM (best of 3)."""
    dst = [torch.empty_like(t) for t in tensors(state)]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors(state), strict=True):
            d.copy_(s)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_prime(state, root: Path, saves: int) -> dict:
    from prime_ckpt import CheckpointManager

    # the default shm_dir: a folder in /dev/shm, as a user gets it (close() removes it)
    mgr = CheckpointManager(root / "prime")
    print(f"  staging in {mgr.shm_dir}", flush=True)
    blocking, durable = [], []
    try:
        for step in range(1, saves + 1):
            next(iter(tensors(state))).add_(1)  # training moved on
            t0 = time.perf_counter()
            h = mgr.save(step, state)
            t1 = time.perf_counter()
            h.wait()
            t2 = time.perf_counter()
            blocking.append(t1 - t0)
            durable.append(t2 - t0)
            print(
                f"  prime-ckpt save {step}: blocking {t1 - t0:.3f}s, durable after {t2 - t0:.2f}s",
                flush=True,
            )
    finally:
        mgr.close()
    return {"blocking": blocking, "durable": durable}


def bench_dcp(state, root: Path, saves: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():  # DCP wants a group; one process needs no rendezvous port
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    blocking, durable = [], []
    for step in range(1, saves + 1):
        next(iter(tensors(state))).add_(1)
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(root / f"dcp-{step % 2}"))
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        blocking.append(t1 - t0)
        durable.append(t2 - t0)
        print(
            f"  dcp.async_save {step}: blocking {t1 - t0:.3f}s, done after {t2 - t0:.2f}s",
            flush=True,
        )
    return {"blocking": blocking, "durable": durable}


def bench_s3(state, root: Path) -> dict:
    import socket
    import subprocess

    import boto3
    import s3fs

    from prime_ckpt import CheckpointManager

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    moto = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        opts = {"key": "x", "secret": "x", "endpoint_url": f"http://127.0.0.1:{port}"}
        client = boto3.client(
            "s3",
            endpoint_url=opts["endpoint_url"],
            aws_access_key_id="x",
            aws_secret_access_key="x",
            region_name="us-east-1",
        )
        for _ in range(300):
            try:
                client.create_bucket(Bucket="bench")
                break
            except Exception:
                time.sleep(0.1)
        mgr = CheckpointManager(root / "s3run", remote="s3://bench/run", remote_options=opts)
        try:
            mgr.save(1, state).wait()
            t0 = time.perf_counter()
            mgr.wait_remote()
            upload = time.perf_counter() - t0
        finally:
            mgr.close()
        data = root / "s3run" / "step-0000000001" / "rank-00000.bin"
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        t0 = time.perf_counter()
        fs.put_file(str(data), "bench/raw.bin")
        raw = time.perf_counter() - t0
        return {"upload": upload, "raw": raw, "bytes": data.stat().st_size}
    finally:
        proc.kill()
        proc.wait()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mib", type=float, default=1024, help="state size (default 1024 = 1 GiB)")
    p.add_argument("--dir", default=None, help="disk folder to write to (default: a temp folder)")
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--dcp-saves", type=int, default=5)
    p.add_argument("--s3", action="store_true", help="also time the upload to a local moto S3")
    p.add_argument(
        "--peer",
        action="store_true",
        help="also run the peer-transfer benchmark (benchmarks/ckpt_peer.py, its defaults)",
    )
    a = p.parse_args()
    if a.saves < 3:
        p.error("--saves must be at least 3 (the median is over saves 3..N)")
    return a


def measure(state: dict, root: Path, a: argparse.Namespace) -> dict:
    """Every timing of the run on `state` in `root`: the torch.save baseline, a RAM copy,
    prime-ckpt, DCP async_save and (with --s3) the upload."""
    print("torch.save + fsync (baseline):", flush=True)
    base = []
    for i in range(3):
        base.append(torch_save_fsync(state, root / "torch.pt"))
        print(f"  torch.save {i + 1}: {base[-1]:.2f}s", flush=True)
    base_s = statistics.median(base)
    copy_s = copy_rate(state)

    print("prime-ckpt:", flush=True)
    pr = bench_prime(state, root, a.saves)
    print("torch.distributed.checkpoint.async_save:", flush=True)
    dc = bench_dcp(state, root, a.dcp_saves)

    s3 = None
    if a.s3:
        print("S3 upload (moto on 127.0.0.1):", flush=True)
        s3 = bench_s3(state, root)
    return {"base_s": base_s, "copy_s": copy_s, "prime": pr, "dcp": dc, "s3": s3}


def print_summary(size: int, saves: int, m: dict) -> None:
    """The figures of `measure`, each as a ratio of the baseline measured in the same run."""
    base_s, copy_s, pr, dc, s3 = m["base_s"], m["copy_s"], m["prime"], m["dcp"], m["s3"]
    steady = statistics.median(pr["blocking"][2:])
    dcp_steady = statistics.median(dc["blocking"][2:] or dc["blocking"])
    gib = size / 2**30
    print("\n== summary ==")
    print(f"state size                          {gib:.3f} GiB")
    print(f"torch.save + fsync                  {base_s:.3f} s (1.00x)")
    print(
        f"prime-ckpt save() blocking, saves 3..{saves} median "
        f"{steady:.3f} s = {steady / base_s:.3f}x torch.save (bar 0.1x, goal 0.05x)"
    )
    print(
        f"prime-ckpt first save() blocking    {pr['blocking'][0]:.3f} s = {pr['blocking'][0] / base_s:.3f}x"
    )
    print(
        f"dcp.async_save blocking (median)    {dcp_steady:.3f} s = {dcp_steady / base_s:.3f}x "
        f"(prime-ckpt is {dcp_steady / steady:.1f}x shorter)"
    )
    print(
        f"staging rate                        {gib / steady:.2f} GiB/s vs torch copy_ "
        f"{gib / copy_s:.2f} GiB/s ({copy_s / steady:.2f}x of copy_)"
    )
    print(
        f"prime-ckpt time until durable       {statistics.median(pr['durable']):.2f} s "
        f"(median) = {statistics.median(pr['durable']) / base_s:.2f}x torch.save"
    )
    print(f"dcp.async_save time until done      {statistics.median(dc['durable']):.2f} s (median)")
    if s3:
        gib_up = s3["bytes"] / 2**30
        print(
            f"S3 upload after durable (moto)      {s3['upload']:.2f} s = "
            f"{gib_up / s3['upload']:.2f} GiB/s vs s3fs put_file of the same bytes "
            f"{s3['raw']:.2f} s ({s3['raw'] / s3['upload']:.2f}x its rate)"
        )


def main() -> int:
    a = parse_args()
    warnings.filterwarnings("ignore")
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=a.dir))
    try:
        state = make_state(int(a.size_mib * 2**20))
        size = nbytes(state)
        print(
            f"state: {size / 2**30:.3f} GiB in {sum(1 for _ in tensors(state))} tensors; disk folder {root}"
        )
        print_summary(size, a.saves, measure(state, root, a))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.peer:
        print("\n== peer transfer (benchmarks/ckpt_peer.py) ==", flush=True)
        import ckpt_peer  # this script's folder is sys.path[0]

        return ckpt_peer.main([] if a.dir is None else ["--dir", a.dir])
    return 0


if __name__ == "__main__":
    sys.exit(main())
