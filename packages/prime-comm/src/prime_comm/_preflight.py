"""The all-reduce's pre-flight: one small all_gather before any data moves.

Every rank sends (length, op, compression, all-finite, its own argument error if any) and
every rank judges the gathered table the same way, so a mismatch, a NaN or a bad argument on
one rank raises a ValueError on all of them instead of leaving the others blocked.
"""

from __future__ import annotations

import struct

import torch

from prime_comm._wait import Waiter

OPS = ("avg", "sum")
COMPRESSIONS = ("uint8", "none", "uint4", "uint2")  # append only: the index is on the wire
_HEAD = struct.Struct("<qqqq")  # numel, op index, compression index, all finite
_MSG_BYTES = 240
RECORD_BYTES = _HEAD.size + _MSG_BYTES


def encode(numel: int, op: int, compression: int, finite: bool, problem: str | None) -> bytes:
    msg = (problem or "").encode("utf-8", "replace")[:_MSG_BYTES]
    return _HEAD.pack(numel, op, compression, int(finite)) + msg.ljust(_MSG_BYTES, b"\0")


def decode(record: bytes) -> tuple[int, int, int, bool, str]:
    numel, op, comp, finite = _HEAD.unpack_from(record)
    msg = record[_HEAD.size :].rstrip(b"\0").decode("utf-8", "replace")
    return numel, op, comp, bool(finite), msg


def exchange(pg, world: int, record: bytes, waiter: Waiter) -> list[bytes]:
    """All-gather one record per rank (bounded by the waiter)."""
    mine = torch.frombuffer(bytearray(record), dtype=torch.uint8)
    if world == 1:
        return [record]
    out = [torch.empty(RECORD_BYTES, dtype=torch.uint8) for _ in range(world)]
    step = "the pre-flight exchange"
    waiter.wait(waiter.issue(lambda: pg.allgather([out], [mine]), step), step)
    return [bytes(t.numpy()) for t in out]


def judge(records: list[bytes], rank: int, local_error: Exception | None) -> None:
    """Raise the same error on every rank when the gathered records disagree or are bad."""
    rows = [decode(r) for r in records]
    faulty = [(i, msg) for i, (_, _, _, _, msg) in enumerate(rows) if msg]
    if faulty:
        if local_error is not None:
            raise local_error
        detail = "; ".join(f"rank {i}: {msg}" for i, msg in faulty)
        raise ValueError(f"all_reduce refused on every rank, nothing was sent ({detail})")
    numels = [r[0] for r in rows]
    if len(set(numels)) > 1:
        raise ValueError(
            f"all_reduce: ranks passed tensors of different lengths {numels}; "
            "every rank must pass the same number of elements"
        )
    ops = [OPS[r[1]] for r in rows]
    if len(set(ops)) > 1:
        raise ValueError(f"all_reduce: ranks passed different ops {ops}; pass the same op")
    comps = [COMPRESSIONS[r[2]] for r in rows]
    if len(set(comps)) > 1:
        raise ValueError(
            f"all_reduce: ranks passed different compression {comps}; pass the same one"
        )
    bad = [i for i, r in enumerate(rows) if not r[3]]
    if bad:
        raise ValueError(
            f"all_reduce: the tensor holds NaN or Inf on rank(s) {bad}; nothing was sent. "
            "Find where the non-finite values come from (e.g. a diverged step) first"
        )
