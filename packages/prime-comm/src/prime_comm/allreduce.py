"""A compressed, abortable all-reduce over any torch.distributed process group (gloo, CPU).

Quantized paths ("uint8", "uint4", "uint2": 8, 4 or 2 bits per element, prime_comm.quant),
per rank r of W: the flat tensor is cut into W chunks, chunk j owned by rank j.
1. Reduce-scatter by direct exchange (all_to_all): every rank quantizes its slice of chunk j
   once and sends it to rank j, which adds the W - 1 decoded slices to its own exact values
   in float32, in rank order (and divides by W for "avg").
2. All-gather: the owner quantizes its reduced chunk once and those bytes travel unchanged;
   every rank, the owner included, decodes the same bytes, so all ranks end bit-identical.
Every input is quantized once and every result once, so the error does not grow with W the
way a ring that re-quantizes at every hop does. Both phases are pipelined over pieces of the
chunks (>= 64K elements): quantizing piece k + 1 overlaps the transfer of piece k.

Error feedback (`residual=`): each rank also writes what the codebooks took from it, in the
units of its input: on the slices it sent, input minus decoded; on the chunk it owns, the
re-quantization error of the reduced chunk times the divisor (W for "avg"), since that error
reached every rank's result through this rank alone. With e_k rank k's residual, every rank's
result is op over k of (x_k - e_k), up to float32 rounding: adding e_k to the next call's
input gives back what this call lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from prime_comm import _kernels, _preflight
from prime_comm._checks import residual_problem, tensor_problem
from prime_comm._wait import Waiter, parse_timeout
from prime_comm.encoded import EncodedResult

MIN_PIECE = 1 << 16
BITS = {"uint8": 8, "uint4": 4, "uint2": 2}  # compression -> bits per element
DEFAULT_PIECE = 1 << 18
FP32_PIECE = 1 << 22  # elements per float32 all-reduce (compression="none"): 16 MB buffers
_ALIGN = 64  # slots start on cache lines (codebooks are read as float32)


def ring_bytes(numel: int, world: int, bytes_per_elem: int = 4) -> int:
    """Bytes one rank sends in an ideal ring all-reduce of `numel` elements over `world`
    ranks: 2 (W - 1) / W of the tensor (reduce-scatter, then all-gather); 0 for W <= 1."""
    if world <= 1:
        return 0
    return 2 * (world - 1) * bytes_per_elem * numel // world


@dataclass(frozen=True)
class AllReduceStats:
    """What one all_reduce moved and how long it took (this rank's view)."""

    bytes_sent: int
    bytes_received: int
    seconds: float
    numel: int
    world_size: int
    compression: str
    encoding: EncodedResult | None = None  # the result's bytes (keep_encoding=True)

    @property
    def fp32_ring_bytes(self) -> int:
        """Bytes one rank sends in an ideal float32 ring all-reduce of the same tensor."""
        return ring_bytes(self.numel, self.world_size)


def _argument_problem(
    tensor: torch.Tensor,
    op_i: int,
    op: str,
    comp_i: int,
    compression: str,
    piece_size: int,
    residual: torch.Tensor | None,
) -> Exception | None:
    """The first problem with `all_reduce`'s arguments on this rank (told to every rank by
    the preflight exchange), or None."""
    problem = tensor_problem(tensor, "tensor")
    if problem is None and tensor.requires_grad:
        problem = ValueError(
            "tensor requires grad and all_reduce writes in place; pass tensor.detach() "
            "(it shares the memory, so the result still lands in tensor)"
        )
    if op_i < 0:
        problem = problem or ValueError(f"op must be 'avg' or 'sum', got {op!r}")
    if comp_i < 0:
        problem = problem or ValueError(
            f"compression must be 'uint8', 'uint4', 'uint2' or 'none', got {compression!r}"
        )
    if isinstance(piece_size, bool) or not isinstance(piece_size, int) or piece_size < MIN_PIECE:
        problem = problem or ValueError(
            f"piece_size must be an int >= {MIN_PIECE}, got {piece_size!r}"
        )
    if problem is None and residual is not None:
        problem = residual_problem(residual, tensor)
    return problem


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | _C10dBackend | None = None,
    op: str = "avg",
    compression: str = "uint8",
    timeout: float | timedelta | None = None,
    should_abort: Callable[[], bool] | None = None,
    piece_size: int = DEFAULT_PIECE,
    residual: torch.Tensor | None = None,
    keep_encoding: bool = False,
) -> AllReduceStats:
    """All-reduce a contiguous float32 CPU tensor in place; every rank ends bit-identical.

    op: "avg" or "sum". compression: "uint8", "uint4" or "uint2" (blockwise codebooks, about
    0.254x, 0.125x and 0.063x the bytes of float32) or "none" (float32 through the group's own
    all_reduce). timeout (seconds or a
    timedelta) bounds the whole call; should_abort is polled at least every 0.25 s. Either
    one ending the call raises CollectiveAborted. piece_size: elements per pipelined piece.

    residual: a float32 CPU tensor of the same length (this rank's own, not shared with
    `tensor`) that receives this rank's quantization error (module doc): the result equals
    op over ranks of (input - residual). Zeros where nothing was quantized ("none", W = 1).
    Unspecified when the call raises.

    keep_encoding: the stats' `encoding` holds the bytes the result was decoded from
    (`EncodedResult`, about 0.25x its float32 bytes at uint8; prime_comm.encoded): its
    `decode()` is the result bit for bit. None where nothing was quantized.
    """
    start = time.perf_counter()
    pg = _resolve_group(group)
    world, rank = pg.size(), pg.rank()
    problem: Exception | None = None
    try:
        timeout_s = parse_timeout(timeout)
    except (TypeError, ValueError) as e:
        problem, timeout_s = e, None
    if should_abort is not None and not callable(should_abort):
        problem = problem or TypeError(
            f"should_abort must be a callable returning bool, got {type(should_abort).__name__}"
        )
        should_abort = None
    waiter = Waiter(timeout_s, should_abort, "all_reduce")
    waiter.check()

    op_i = _index(_preflight.OPS, op)
    comp_i = _index(_preflight.COMPRESSIONS, compression)
    problem = problem or _argument_problem(tensor, op_i, op, comp_i, compression, piece_size,
                                           residual)  # fmt: skip
    if not isinstance(keep_encoding, bool):
        problem = problem or TypeError(f"keep_encoding must be a bool, got {keep_encoding!r}")
    ok = problem is None
    numel = tensor.numel() if ok else -1
    finite = ok and _kernels.all_finite(tensor.data_ptr(), numel)
    record = _preflight.encode(numel, max(op_i, 0), max(comp_i, 0), finite, _describe(problem))
    records = _preflight.exchange(pg, world, record, waiter)
    _preflight.judge(records, rank, problem)
    sent = received = (world - 1) * _preflight.RECORD_BYTES

    flat = tensor.view(-1)
    res = None if residual is None else residual.view(-1)
    quantized = world > 1 and numel > 0 and compression != "none"
    if res is not None and not quantized:
        res.zero_()
    encoding = None
    if world > 1 and numel > 0:
        if compression == "none":
            s, r = _fp32_all_reduce(pg, flat, world, op, waiter)
        else:
            bits = BITS[compression]
            run = _QuantAllReduce(pg, flat, world, rank, op, piece_size, waiter, bits, res)
            if keep_encoding:
                run.keep_encoding()
            s, r = run.run()
            encoding = run.encoding
        sent, received = sent + s, received + r
    return AllReduceStats(
        sent, received, time.perf_counter() - start, max(numel, 0), world, str(compression),
        encoding,
    )  # fmt: skip


def _resolve_group(group: object) -> dist.ProcessGroup:
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "all_reduce needs a process group: call torch.distributed.init_process_group "
                "first or pass group="
            )
        return dist.group.WORLD  # (the default group, once initialized)
    if not isinstance(group, dist.ProcessGroup | _C10dBackend):
        raise TypeError(
            "group must be a torch.distributed ProcessGroup (or a gloo backend such as "
            f"ProcessGroupGloo) that this rank belongs to, got {type(group).__name__}"
        )
    return group


def _index(options: tuple[str, ...], value: object) -> int:
    return options.index(value) if isinstance(value, str) and value in options else -1


def _describe(problem: Exception | None) -> str | None:
    return None if problem is None else f"{type(problem).__name__}: {problem}"


def _fp32_all_reduce(pg, flat: torch.Tensor, world: int, op: str, waiter: Waiter):
    """The group's own float32 all-reduce, in pieces of `FP32_PIECE` elements through two
    buffers (piece k + 1 is on the wire while piece k is copied back): the group writes into
    a buffer, never the caller's tensor (after an abort a late peer could still complete a
    pending collective), and no whole-tensor copy is made (it cost 4 bytes per element)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    n = flat.numel()
    bufs = [torch.empty(min(n, FP32_PIECE)) for _ in range(2 if n > FP32_PIECE else 1)]
    step = "the float32 all-reduce"
    pending: list[tuple[int, int, torch.Tensor, object]] = []
    for k, a in enumerate(range(0, n, FP32_PIECE)):
        b = min(n, a + FP32_PIECE)
        buf = bufs[k % len(bufs)][: b - a]
        if len(pending) == len(bufs):  # that buffer's piece must be back first
            _fp32_piece_done(flat, pending.pop(0), world, op, waiter, step)
        buf.copy_(flat[a:b])
        work = waiter.issue(lambda buf=buf: pg.allreduce([buf], opts), step)
        pending.append((a, b, buf, work))
    for p in pending:
        _fp32_piece_done(flat, p, world, op, waiter, step)
    ring = ring_bytes(n, world)
    return ring, ring


def _fp32_piece_done(flat, piece, world: int, op: str, waiter: Waiter, step: str) -> None:
    a, b, buf, work = piece
    waiter.wait(work, step)
    if op == "avg":
        buf.div_(world)
    flat[a:b].copy_(buf)


def _slot(n: int, bits: int) -> int:
    return -(-_kernels.encoded_bytes(n, bits) // _ALIGN) * _ALIGN


class _QuantAllReduce:
    """One quantized all-reduce: the chunk/piece geometry and the pipelined schedule."""

    def __init__(self, pg, flat, world, rank, op, piece, waiter, bits, residual=None) -> None:
        self.pg, self.flat, self.world, self.rank, self.waiter = pg, flat, world, rank, waiter
        self.bits, self.residual = bits, residual
        self.divisor = float(world) if op == "avg" else 1.0
        n = flat.numel()
        self.chunk = -(-n // world)
        self.starts = [min(j * self.chunk, n) for j in range(world)]
        self.lens = [min((j + 1) * self.chunk, n) - self.starts[j] for j in range(world)]
        self.piece = piece
        self.rounds = -(-self.chunk // piece)
        self.base = flat.data_ptr()
        self.sent = self.received = 0
        self.encoding: EncodedResult | None = None
        self._kept: dict[tuple[int, int], int] = {}  # (chunk, piece) -> offset in encoding

    def keep_encoding(self) -> None:
        """Keep the all-gathered pieces, in the tensor's order (chunk by chunk), as
        `self.encoding`."""
        pieces, off = [], 0
        for j in range(self.world):
            for r in range(self.rounds):
                if self._len(j, r):
                    pieces.append(self._len(j, r))
                    self._kept[(j, r)] = off
                    off += _kernels.encoded_bytes(self._len(j, r), self.bits)
        data = torch.empty(off, dtype=torch.uint8)
        self.encoding = EncodedResult(data, self.bits, tuple(pieces))

    def _len(self, j: int, r: int) -> int:
        return max(0, min(self.lens[j] - r * self.piece, self.piece))

    def _ptr(self, j: int, r: int) -> int:
        return self.base + 4 * (self.starts[j] + r * self.piece)

    def run(self) -> tuple[int, int]:
        rs = {0: self._issue_rs(0)}
        ag = {}
        for r in range(self.rounds):
            if r + 1 < self.rounds:
                rs[r + 1] = self._issue_rs(r + 1)  # quantize the next piece during transfer
            self._finish_rs(r, *rs.pop(r))
            ag[r] = self._issue_ag(r)
            if r >= 1:
                self._finish_ag(r - 1, *ag.pop(r - 1))
        self._finish_ag(self.rounds - 1, *ag.pop(self.rounds - 1))
        return self.sent, self.received

    def _issue_rs(self, r: int):
        self.waiter.check()
        me, world = self.rank, self.world
        in_splits = [0 if j == me else _slot(self._len(j, r), self.bits) for j in range(world)]
        out_splits = [0 if i == me else _slot(self._len(me, r), self.bits) for i in range(world)]
        send = torch.empty(sum(in_splits), dtype=torch.uint8)
        recv = torch.empty(sum(out_splits), dtype=torch.uint8)
        jobs, off = [], 0
        for j in range(world):
            if in_splits[j]:
                n = self._len(j, r)
                jobs.append((self._ptr(j, r), n, send.data_ptr() + off))
                send[off + _kernels.encoded_bytes(n, self.bits) : off + in_splits[j]].zero_()
            off += in_splits[j]
        # The pre-flight saw finite data: a NaN or Inf now means it changed since.
        if _kernels.quantize_many(jobs, self.bits) >= 0:
            raise RuntimeError("all_reduce: the tensor was modified during the call")
        if self.residual is not None:  # input - decoded, on the slices sent
            self._keep_error([(j, r) for j in range(world) if in_splits[j]], jobs, 1.0)
        work = self.waiter.issue(
            lambda: self.pg.alltoall_base(recv, send, out_splits, in_splits),
            f"reduce-scatter piece {r}",
        )
        self.sent += send.numel()
        self.received += recv.numel()
        return work, recv, out_splits, send

    def _finish_rs(self, r: int, work, recv, out_splits, send) -> None:
        self.waiter.wait(work, f"reduce-scatter piece {r}")
        offsets, off = [], recv.data_ptr()
        for i in range(self.world):
            if out_splits[i]:
                offsets.append(off)
            off += out_splits[i]
        _kernels.reduce_into(
            self._ptr(self.rank, r), self._len(self.rank, r), offsets, self.divisor, self.bits
        )

    def _issue_ag(self, r: int):
        self.waiter.check()
        size = _slot(self._len(0, r), self.bits)  # chunk 0 is the longest: every slot fits
        n = self._len(self.rank, r)
        send = torch.empty(size, dtype=torch.uint8)
        send[_kernels.encoded_bytes(n, self.bits) :].zero_()
        job = [(self._ptr(self.rank, r), n, send.data_ptr())]
        if _kernels.quantize_many(job, self.bits) >= 0:
            raise RuntimeError("all_reduce: the tensor was modified during the call")
        if self.residual is not None and n:  # every rank's result lost this: scale it back
            self._keep_error([(self.rank, r)], job, self.divisor)
        recv = [torch.empty(size, dtype=torch.uint8) for _ in range(self.world)]
        work = self.waiter.issue(lambda: self.pg.allgather([recv], [send]), f"all-gather piece {r}")
        # gloo's all-gather is a ring: each rank forwards W - 1 slots of this size.
        self.sent += (self.world - 1) * size
        self.received += (self.world - 1) * size
        return work, recv, send

    def _keep_error(self, pieces, jobs, scale: float) -> None:
        """residual = scale * (values - decode(their encoding)) on each (chunk, piece), decoded
        from the bytes about to be sent, so it is exactly what the receivers will see."""
        base = self.residual.data_ptr()
        decode = [(enc, n, base + (src - self.base)) for src, n, enc in jobs]
        _kernels.dequantize_many(decode, False, self.bits)
        for j, r in pieces:
            a = self.starts[j] + r * self.piece
            res, x = self.residual[a : a + self._len(j, r)], self.flat[a : a + self._len(j, r)]
            torch.sub(x, res, out=res)
            if scale != 1.0:
                res.mul_(scale)

    def _finish_ag(self, r: int, work, recv, send) -> None:
        self.waiter.wait(work, f"all-gather piece {r}")
        jobs = [
            (recv[i].data_ptr(), self._len(i, r), self._ptr(i, r))
            for i in range(self.world)
            if self._len(i, r)
        ]
        _kernels.dequantize_many(jobs, False, self.bits)
        if self.encoding is not None:
            for i in range(self.world):
                if (i, r) in self._kept:
                    a, n = self._kept[(i, r)], _kernels.encoded_bytes(self._len(i, r), self.bits)
                    self.encoding.data[a : a + n].copy_(recv[i][:n])
