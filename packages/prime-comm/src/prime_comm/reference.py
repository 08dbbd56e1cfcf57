"""The quantization scheme in plain, vectorised torch: the yardstick for the C++ kernels.

The tests check the kernels against these functions and the benchmark reports the kernels'
speed against them. 8 bits: the codes match the kernels exactly; the codebook here is the
exact bin mean, the kernels' is within 1/65536 of a bin width of it. 4 and 2 bits: the
codebook here takes the block's mean and standard deviation in float64, the kernels' sums
round differently (relative differences near 1e-7); `codes_ref` gives the codes the kernels
must write for a given codebook, exactly, and `pack_codes_ref` their packed layout.
"""

from __future__ import annotations

import torch

from prime_comm.quant import BLOCK, LEVELS

# The Lloyd-Max levels of a standard normal (least mean squared error for Gaussian data).
_HALF = {
    4: (0.12839502985114704, 0.38804829949029063, 0.65675911853246327, 0.94234045648696196,
        1.2562311973471756, 1.6180463860218808, 2.0690172265313875, 2.7325895709951631),
    2: (0.45278003463649208, 1.5104176084990959),
}  # fmt: skip
NORMAL_LEVELS = {b: tuple(-v for v in reversed(h)) + h for b, h in _HALF.items()}


def quantize_ref(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(codebooks of shape (n_blocks, 2**bits) float32, codes of shape (numel,) uint8, one
    code per element, unpacked)."""
    if bits != 8:
        return _quantize_lowbit_ref(x, bits)
    x = x.reshape(-1)
    n = x.numel()
    nb = -(-n // BLOCK)
    if n == 0:
        return torch.empty(0, LEVELS), torch.empty(0, dtype=torch.uint8)
    pad = nb * BLOCK - n
    # Pad the last block with one of its own values, so its min and max stay the same.
    xb = torch.cat([x, x[-1:].expand(pad)]).view(nb, BLOCK)
    lo, hi = xb.amin(1), xb.amax(1)
    rng = hi.double() - lo.double()
    scale = torch.where(rng > 0, LEVELS / rng.clamp(min=1e-300), 0.0).float()
    codes = ((xb - lo[:, None]) * scale[:, None]).to(torch.int64).clamp(max=LEVELS - 1)
    codes = codes.reshape(-1)[:n]
    bins = torch.arange(n) // BLOCK * LEVELS + codes
    counts = torch.bincount(bins, minlength=nb * LEVELS).view(nb, LEVELS).double()
    sums = torch.bincount(bins, weights=x.double(), minlength=nb * LEVELS).view(nb, LEVELS)
    centres = lo.double()[:, None] + (torch.arange(LEVELS) + 0.5) * (rng / LEVELS)[:, None]
    book = torch.where(counts > 0, sums / counts.clamp(min=1), centres)
    book = torch.minimum(torch.maximum(book, lo.double()[:, None]), hi.double()[:, None])
    return book.float(), codes.to(torch.uint8)


def _quantize_lowbit_ref(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.reshape(-1)
    n, levels = x.numel(), 1 << bits
    if n == 0:
        return torch.empty(0, levels), torch.empty(0, dtype=torch.uint8)
    books = []
    for xb in x.split(BLOCK):
        d = xb.double()
        mu, sigma = d.mean(), d.std(correction=0)
        y = mu + sigma * torch.tensor(NORMAL_LEVELS[bits], dtype=torch.float64)
        books.append(torch.clamp(y, d.min(), d.max()).float())
    books = torch.stack(books)
    return books, codes_ref(x, books)


def codes_ref(x: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """The 4- or 2-bit codes of x for the given (ascending) codebooks: the nearest level, i.e.
    the number of float midpoints of adjacent levels that are <= x. Unpacked, (numel,) uint8."""
    x = x.reshape(-1)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    for b, xb in enumerate(x.split(BLOCK) if x.numel() else ()):
        y = codebooks[b].double()
        th = ((y[:-1] + y[1:]) * 0.5).float()
        out[b * BLOCK : b * BLOCK + xb.numel()] = torch.searchsorted(th, xb, right=True)
    return out


def pack_codes_ref(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unpacked 4- or 2-bit codes as the kernels do: groups of 128 / bits elements fill
    16 bytes, byte j holding elements j, j + 16, ... from the low bits up; a final partial
    group is packed in order (element i at byte i * bits // 8, low bits first)."""
    codes = codes.reshape(-1).to(torch.int32)
    per = 8 // bits
    group = 16 * per
    full = codes.numel() // group
    body = codes[: full * group].view(full, per, 16)
    shifts = (torch.arange(per, dtype=torch.int32) * bits).view(1, per, 1)
    packed = (body << shifts).sum(1).reshape(-1)
    tail = codes[full * group :]
    pad = -tail.numel() % per
    tail = torch.cat([tail, tail.new_zeros(pad)]).view(-1, per)
    tail = (tail << (torch.arange(per, dtype=torch.int32) * bits)).sum(1)
    return torch.cat([packed, tail]).to(torch.uint8)


def unpack_codes_ref(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """The inverse of `pack_codes_ref`: (numel,) uint8 codes."""
    per = 8 // bits
    group = 16 * per
    full = numel // group
    p = packed.reshape(-1).to(torch.int32)
    mask = (1 << bits) - 1
    shifts = torch.arange(per, dtype=torch.int32) * bits
    body = (p[: full * 16].view(full, 1, 16) >> shifts.view(1, per, 1)) & mask
    tail = ((p[full * 16 :].view(-1, 1) >> shifts.view(1, per)) & mask).reshape(-1)
    return torch.cat([body.reshape(-1), tail[: numel - full * group]]).to(torch.uint8)


def dequantize_ref(codebooks: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Decode unpacked codes: each looks up its block's codebook (index_select)."""
    levels = codebooks.shape[-1] if codebooks.dim() == 2 else LEVELS
    idx = torch.arange(codes.numel()) // BLOCK * levels + codes.long()
    return codebooks.reshape(-1).index_select(0, idx)
