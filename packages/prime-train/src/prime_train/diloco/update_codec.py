"""How the update log stores an averaged pseudo-gradient: the exact float32 bits back.

After a quantized all-reduce every node decoded its average from the same bytes, the owners'
quantized pieces (`prime_comm.EncodedResult`, kept by `all_reduce(keep_encoding=True)`: about
1 byte per element at uint8, 0.5 at uint4). The entry stores those bytes and the factor
applied after them (the average over the contributors when some nodes sent nothing), so
packing is one copy of the codes and replaying is a decode; nothing searches the floats for
their few distinct values again (a hash per row of them cost ~18x a memcpy of the weights).
Where nothing was quantized (compression = "none", a run of one node) the float32 bytes are
stored as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import prime_comm


@dataclass(frozen=True)
class Encoded:
    """An averaged update as its all-reduce's encoding times `scale` (applied after the
    decode, as the average was)."""

    encoding: prime_comm.EncodedResult
    scale: float = 1.0


def pack(x: torch.Tensor, encoded: Encoded | None = None) -> dict[str, object]:
    """The msgpack-able packing of flat float32 `x`: `encoded`'s bytes when given (it must be
    the encoding `x` was decoded from), else `x`'s own bytes (a view: pack before `x` changes;
    the bytes fields are memoryviews, which msgpack writes as bin)."""
    x = x.detach().to("cpu").contiguous().view(-1)
    if encoded is None:
        return {"kind": "raw", "numel": x.numel(), "data": memoryview(x.numpy()).cast("B")}
    e = encoded.encoding
    if e.numel != x.numel():
        raise ValueError(f"an encoding of {e.numel} elements for an update of {x.numel()}")
    return {
        "kind": "codes",
        "numel": e.numel,
        "bits": e.bits,
        "pieces": list(e.pieces),
        "scale": float(encoded.scale),
        "data": memoryview(e.data.numpy()),
    }


def unpack(d: dict) -> torch.Tensor:
    """The float32 tensor `pack` packed, bit for bit; ValueError if `d` is malformed."""
    n = int(d["numel"])
    if d["kind"] == "raw":
        data = bytearray(d["data"])
        if len(data) != 4 * n:
            raise ValueError(f"raw update of {len(data)} bytes for {n} floats")
        return torch.frombuffer(data, dtype=torch.float32) if n else torch.zeros(0)
    if d["kind"] != "codes":
        raise ValueError(f"unknown update packing {d['kind']!r}")
    try:
        data = torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8)
        pieces = tuple(int(p) for p in d["pieces"])
        encoding = prime_comm.EncodedResult(data, int(d["bits"]), pieces)
    except (TypeError, ValueError) as e:
        raise ValueError(f"update packing: {e}") from e
    if encoding.numel != n:
        raise ValueError(f"update packing: pieces of {encoding.numel} elements for {n}")
    return decode(Encoded(encoding, float(d["scale"])))


def decode(encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
    """The averaged update `encoded` holds, bit for bit (a new tensor, or written into `out`,
    contiguous float32 of its length)."""
    out = encoded.encoding.decode(out)
    if encoded.scale != 1.0:
        out.mul_(encoded.scale)
    return out
