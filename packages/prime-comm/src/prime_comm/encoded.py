"""A quantized all-reduce's result as the bytes every rank decoded it from.

`all_reduce(..., keep_encoding=True)` hands them out (`AllReduceStats.encoding`): in the
all-gather each owner's reduced chunk travels once as its quantized pieces, and every rank
decodes the same bytes, so those pieces, in the tensor's order, are the result itself at
about a quarter of its float32 size (uint8). Storing or sending them instead of the floats
costs one copy of the codes, where any encoding of the floats after the fact needs a pass
that finds their few distinct values again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime_comm import _kernels
from prime_comm._checks import check_bits, check_float_tensor


@dataclass(frozen=True)
class EncodedResult:
    """The encoding of a flat float32 result: `pieces` (elements of each quantized piece, in
    the tensor's order; each its own `prime_comm.quantize` encoding at `bits`) laid end to end
    in `data` (uint8). `decode()` gives the result back bit for bit."""

    data: torch.Tensor
    bits: int
    pieces: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.pieces)

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if any(not isinstance(n, int) or n <= 0 for n in self.pieces):
            raise ValueError("every piece must hold a positive number of elements")
        d = self.data
        if not isinstance(d, torch.Tensor) or d.dtype != torch.uint8 or d.dim() != 1:
            raise TypeError("data must be a 1-D uint8 tensor")
        if not d.is_contiguous() or d.device.type != "cpu":
            raise ValueError("data must be a contiguous CPU tensor")
        need = sum(_kernels.encoded_bytes(n, self.bits) for n in self.pieces)
        if d.numel() != need:
            raise ValueError(f"data holds {d.numel()} bytes, its pieces need {need}")

    def decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The result (a new flat float32 tensor, or written into `out`, contiguous float32 of
        `numel` elements)."""
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32)
        check_float_tensor(out, "out")
        if out.numel() != self.numel:
            raise ValueError(f"out has {out.numel()} elements, the encoding {self.numel}")
        jobs, src, dst = [], self.data.data_ptr(), out.data_ptr()
        for n in self.pieces:
            jobs.append((src, n, dst))
            src += _kernels.encoded_bytes(n, self.bits)
            dst += 4 * n
        _kernels.dequantize_many(jobs, False, self.bits)
        return out
