"""Lossless packing of an averaged pseudo-gradient: about 1 byte per element after a uint8
all-reduce, the exact float32 bits back.

The all-reduce's result is decoded from blockwise codebooks (prime_comm: 2^bits values per
block of 65536 elements), so a run of elements takes few distinct values. The flat tensor is
cut into rows of `ROW` elements; each row stores its distinct 32-bit patterns once (in order
of first appearance; bit patterns, so -0.0 and 0.0 stay apart) and, per element, the index of
its value: one byte
when the row has at most 256 distinct values, two otherwise (a row never has more than
`ROW` <= 65536). Any float32 tensor round-trips bit for bit; one without few values per row
(compression = "none") costs up to 6 bytes per element instead of 4, so it is stored raw.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

ROW = 16384  # elements per row: a quarter of prime_comm's block, most rows lie in one block


def pack(x: torch.Tensor) -> dict[str, bytes | memoryview | int]:
    """The msgpack-able packing of flat float32 `x` (see module doc), read from `x` row by
    row: no copy of it, each row's values found by hashing (pyarrow's `dictionary_encode`,
    one pass, where a sort took ~14) and its indices written straight into one byte per
    element (the bytes fields may be memoryviews, which msgpack writes as bin)."""
    x = x.detach().to("cpu").contiguous().view(-1)
    n = x.numel()
    if n == 0:
        return _raw(x)
    rows = -(-n // ROW)
    bits = x.view(torch.int32).numpy()
    idx8 = np.empty(rows * ROW, dtype=np.uint8)  # the small rows' indices, in order
    counts = np.empty(rows, dtype=np.int32)
    uniques, idx16, filled = [], [], 0
    for r in range(rows):
        row = bits[r * ROW : (r + 1) * ROW]
        if row.size < ROW:  # the last row: padded with zeros, one more value in it
            row = np.concatenate([row, np.zeros(ROW - row.size, dtype=np.int32)])
        encoded = pc.dictionary_encode(pa.array(row))
        values = encoded.dictionary.to_numpy(zero_copy_only=False)
        index = encoded.indices.to_numpy(zero_copy_only=False)
        counts[r] = values.size
        uniques.append(values)  # (in order of first appearance: any order round-trips)
        if values.size <= 256:
            idx8[filled : filled + ROW] = index
            filled += ROW
        else:  # < 65536: the int16 bits hold it
            idx16.append(index.astype(np.int16))
    u = np.concatenate(uniques)
    i16 = np.concatenate(idx16) if idx16 else np.zeros(0, dtype=np.int16)
    size = 4 * rows + 4 * u.size + filled + 2 * i16.size
    if size >= 4 * n:
        return _raw(x)
    return {
        "kind": "rows",
        "numel": n,
        "counts": counts.tobytes(),
        "uniques": u.astype(np.int32).tobytes(),
        "idx8": memoryview(idx8[:filled]),
        "idx16": i16.tobytes(),
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
