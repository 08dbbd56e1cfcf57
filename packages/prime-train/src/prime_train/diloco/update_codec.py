"""Lossless packing of an averaged pseudo-gradient: about 1 byte per element after a uint8
all-reduce, the exact float32 bits back.

The all-reduce's result is decoded from blockwise codebooks (prime_comm: 2^bits values per
block of 65536 elements), so a run of elements takes few distinct values. The flat tensor is
cut into rows of `ROW` elements; each row stores its distinct 32-bit patterns once (sorted by
bit pattern, so -0.0 and 0.0 stay apart) and, per element, the index of its value: one byte
when the row has at most 256 distinct values, two otherwise (a row never has more than
`ROW` <= 65536). Any float32 tensor round-trips bit for bit; one without few values per row
(compression = "none") costs up to 6 bytes per element instead of 4, so it is stored raw.
"""

from __future__ import annotations

import torch

ROW = 16384  # elements per row: a quarter of prime_comm's block, most rows lie in one block
SLAB = 64  # rows sorted at once (bounds the temporary memory to ~30 bytes x SLAB x ROW: 32 MB)


def pack(x: torch.Tensor) -> dict[str, bytes | memoryview | int]:
    """The msgpack-able packing of flat float32 `x` (see module doc), read from `x` slab by
    slab: no copy of it, and the indices written straight into one byte per element (the
    bytes fields may be memoryviews of them, which msgpack writes as bin)."""
    x = x.detach().to("cpu").contiguous().view(-1)
    n = x.numel()
    if n == 0:
        return _raw(x)
    rows = -(-n // ROW)
    bits = x.view(torch.int32)
    idx8 = torch.empty(rows * ROW, dtype=torch.uint8)  # the small rows' indices, in order
    counts, uniques, idx16, filled = [], [], [], 0
    for r0 in range(0, rows, SLAB):
        slab = bits[r0 * ROW : (r0 + SLAB) * ROW]
        if slab.numel() % ROW:  # the last row: padded with zeros, one more value in it
            slab = torch.cat([slab, slab.new_zeros(ROW - slab.numel() % ROW)])
        s, perm = slab.view(-1, ROW).sort(dim=1)
        new = torch.ones_like(s, dtype=torch.bool)
        new[:, 1:] = s[:, 1:] != s[:, :-1]
        rank = new.cumsum(1, dtype=torch.int32) - 1
        idx = torch.empty_like(rank).scatter_(1, perm, rank)
        c = rank[:, -1] + 1
        counts.append(c)
        uniques.append(s[new])  # row-major: each row's values in turn
        small = c <= 256
        k = int(small.sum()) * ROW
        idx8[filled : filled + k] = idx[small].view(-1)  # (< 256: the uint8 cast is exact)
        filled += k
        idx16.append(idx[~small].to(torch.int16).view(-1))  # < 65536: the int16 bits hold it
    count = torch.cat(counts)
    u, i16 = torch.cat(uniques), torch.cat(idx16)
    size = 4 * count.numel() + 4 * u.numel() + filled + 2 * i16.numel()
    if size >= 4 * n:
        return _raw(x)
    return {
        "kind": "rows",
        "numel": n,
        "counts": count.numpy().tobytes(),
        "uniques": u.numpy().tobytes(),
        "idx8": memoryview(idx8[:filled].numpy()),
        "idx16": i16.numpy().tobytes(),
    }


def _raw(x: torch.Tensor) -> dict[str, bytes | memoryview | int]:
    """The raw packing: the float32 bytes themselves (a view of `x`: pack it before `x`
    changes)."""
    return {"kind": "raw", "numel": x.numel(), "data": memoryview(x.numpy()).cast("B")}


def unpack(d: dict) -> torch.Tensor:
    """The float32 tensor `pack` packed, bit for bit; ValueError if `d` is malformed."""
    n = int(d["numel"])
    if d["kind"] == "raw":
        data = bytes(d["data"])
        if len(data) != 4 * n:
            raise ValueError(f"raw update of {len(data)} bytes for {n} floats")
        return torch.frombuffer(bytearray(data), dtype=torch.float32) if n else torch.zeros(0)
    if d["kind"] != "rows":
        raise ValueError(f"unknown update packing {d['kind']!r}")
    count = _ints(d["counts"], torch.int32).long()
    uniques = _ints(d["uniques"], torch.int32)
    i8, i16 = _ints(d["idx8"], torch.uint8), _ints(d["idx16"], torch.int16)
    rows = -(-n // ROW)
    small = count <= 256
    if count.numel() != rows or int(count.sum()) != uniques.numel():
        raise ValueError("update packing: row counts do not match")
    if i8.numel() != int(small.sum()) * ROW or i16.numel() != int((~small).sum()) * ROW:
        raise ValueError("update packing: index sizes do not match")
    idx = torch.empty(rows, ROW, dtype=torch.long)
    idx[small] = i8.view(int(small.sum()), ROW).long()
    idx[~small] = i16.view(int((~small).sum()), ROW).long() & 0xFFFF
    if bool((idx >= count[:, None]).any()):
        raise ValueError("update packing: an index past its row's values")
    start = torch.cumsum(count, 0) - count
    out = uniques[(start[:, None] + idx).view(-1)][:n]
    return out.view(torch.float32).clone()


def _ints(b: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=dtype) if b else torch.zeros(0, dtype=dtype)
