"""The all-reduce test cases, run by the session's rank pool (prime_testkit.RankPool).

Each `case_NAME(ctx, **args)` runs on ranks 0..world-1 of the pool, in `ctx.pg`: the
subgroup of that size, or a fresh gloo group (`pool4.fresh_group()`), which the abort cases
use because an aborted group is left unusable. It returns what the test checks, as JSON.
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import torch

import prime_comm


def _single_thread() -> None:
    # Four ranks share two cores: one thread each keeps them from thrashing.
    torch.set_num_threads(1)
    prime_comm.set_num_threads(1)


def case_reduce(
    ctx,
    n,
    op="avg",
    compression="uint8",
    seed=0,
    kind="normal",
    use_default=False,
    piece_size=prime_comm.allreduce.DEFAULT_PIECE,
):
    pg, world = ctx.pg, ctx.world
    _single_thread()
    x = make_input(kind, n, seed, ctx.rank)
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


def case_residual(ctx, n, op="avg", compression="uint2", seed=0, piece_size=1 << 16):
    """One all_reduce with residual=: the result against op over ranks of (x - residual)
    (float64), and this rank's residual on the chunks it sent against quantize() of them."""
    pg, world, rank = ctx.pg, ctx.world, ctx.rank
    _single_thread()
    x = make_input("normal", n, seed, rank)
    sent = x.clone()
    res = torch.full((n,), float("nan"))  # every element must be written
    prime_comm.all_reduce(
        x, group=pg, op=op, compression=compression, timeout=60.0, piece_size=piece_size,
        residual=res,
    )  # fmt: skip
    meant = (sent - res).double()
    pg.allreduce([meant]).wait()
    if op == "avg":
        meant /= world
    chunk = -(-n // world)
    others = [j for j in range(world) if j != rank and j * chunk < n]
    exact_sent = True  # one piece per chunk here: each chunk slice is encoded whole
    if chunk <= piece_size and compression != "none":
        bits = prime_comm.allreduce.BITS[compression]
        for j in others:
            part = sent[j * chunk : (j + 1) * chunk]
            lost = part - prime_comm.dequantize(prime_comm.quantize(part, bits=bits))
            exact_sent &= torch.equal(res[j * chunk : (j + 1) * chunk], lost)
    scale = meant.abs().max().item() or 1.0
    return {
        "digest": hashlib.sha256(x.numpy().tobytes()).hexdigest(),
        "identity_err": (x.double() - meant).abs().max().item() / scale,
        "finite": bool(torch.isfinite(res).all()),
        "zero": bool((res == 0).all()),
        "exact_sent": bool(exact_sent),
    }


def case_encoding(ctx, n, compression="uint8", seed=0, piece_size=1 << 16):
    """One all_reduce with keep_encoding=True: whether the encoding decodes to the result bit
    for bit, its size against the float32 bytes, and the same bytes on every rank."""
    _single_thread()
    x = make_input("normal", n, seed, ctx.rank)
    stats = prime_comm.all_reduce(
        x, group=ctx.pg, compression=compression, timeout=60.0, piece_size=piece_size,
        keep_encoding=True,
    )  # fmt: skip
    enc = stats.encoding
    if enc is None:
        return {"encoding": None, "digest": hashlib.sha256(x.numpy().tobytes()).hexdigest()}
    return {
        "encoding": hashlib.sha256(enc.data.numpy().tobytes()).hexdigest(),
        "digest": hashlib.sha256(x.numpy().tobytes()).hexdigest(),
        "exact": torch.equal(enc.decode().view(torch.int32), x.view(torch.int32)),
        "ratio": enc.data.numel() / (4 * n),
        "numel": enc.numel,
        "pieces": len(enc.pieces),
    }


def case_feedback(ctx, n, rounds, compression="uint2", feedback=True, seed=0):
    """`rounds` all-reduces of fresh inputs, each rank adding its last residual to the next
    input (or not): the relative L2 error of the summed results against the summed exact
    averages, and of the last round alone."""
    pg, world, rank = ctx.pg, ctx.world, ctx.rank
    _single_thread()
    res = torch.zeros(n)
    got_sum, exact_sum = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for t in range(rounds):
        x = make_input("normal", n, seed + t, rank)
        exact = x.double()
        pg.allreduce([exact]).wait()
        exact /= world
        if feedback:
            x += res
        prime_comm.all_reduce(x, group=pg, compression=compression, timeout=60.0, residual=res)
        got_sum += x.double()
        exact_sum += exact
    return {"sum_err": ((got_sum - exact_sum).norm() / exact_sum.norm()).item()}


def case_bad(ctx, bad_rank, kind, n=1000):
    pg = ctx.pg
    _single_thread()
    x = make_input("normal", n, 1, ctx.rank)
    kwargs = {"op": "avg", "compression": "uint8", "timeout": 30.0}
    arg = x
    if ctx.rank == bad_rank:
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
        elif kind == "compression_bits":
            kwargs["compression"] = "uint4"
        elif kind == "bad_compression":
            kwargs["compression"] = "uint3"
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
        elif kind == "residual_length":
            kwargs["residual"] = torch.zeros(n + 1)
        elif kind == "residual_dtype":
            kwargs["residual"] = torch.zeros(n, dtype=torch.float64)
        elif kind == "residual_alias":
            kwargs["residual"] = x
        elif kind == "keep_encoding":
            kwargs["keep_encoding"] = "yes"
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
    y = make_input("normal", 4096, 2, ctx.rank)
    prime_comm.all_reduce(y, group=pg, timeout=30.0)
    out["after"] = hashlib.sha256(y.numpy().tobytes()).hexdigest()
    return out


def case_abort(ctx, mode, stall_rank, n=1 << 20, after=0.5, stall=1.5, late_timeout=1.0):
    """Every rank but stall_rank calls all_reduce; stall_rank sleeps, then calls late."""
    pg = ctx.pg
    _single_thread()
    x = make_input("normal", n, 3, ctx.rank)
    t0 = time.monotonic()
    if ctx.rank == stall_rank:
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


def case_abort_midway(ctx, abort_rank, n=1 << 21, calls=3):
    """All ranks start; abort_rank's should_abort turns true after `calls` polls."""
    pg = ctx.pg
    _single_thread()
    x = make_input("normal", n, 4, ctx.rank)
    polls = [0]

    def should_abort() -> bool:
        polls[0] += 1
        return ctx.rank == abort_rank and polls[0] > calls

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


def case_sleep(ctx, seconds):
    _single_thread()
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


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise KeyError(field)


def case_peak_memory(ctx, n, compression="uint8", seed=0):
    """One all_reduce of `n` floats: how far this rank's peak RSS (VmHWM, reset through
    /proc/self/clear_refs just before) rose above its RSS at the call's start, and the
    result's digest and error against the group's own float32 sum."""
    pg, world = ctx.pg, ctx.world
    _single_thread()
    x = make_input("normal", n, seed, ctx.rank)
    exact = x.clone()
    pg.allreduce([exact]).wait()
    exact /= world
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    before = _vm("VmRSS")
    prime_comm.all_reduce(x, group=pg, compression=compression, timeout=120.0)
    rise = _vm("VmHWM") - before
    return {
        "digest": hashlib.sha256(x.numpy().tobytes()).hexdigest(),
        "rel_err": ((x - exact).norm() / exact.norm()).item(),
        "peak_rise": rise,
    }
