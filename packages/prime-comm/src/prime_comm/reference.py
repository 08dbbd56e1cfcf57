"""The quantization scheme in plain, vectorised torch: the yardstick for the C++ kernels.

The tests check the kernels against these functions and the benchmark reports the kernels'
speed against them. The codes match the kernels exactly; the codebook here is the exact bin
mean, the kernels' is within 1/65536 of a bin width of it.
"""

from __future__ import annotations

import torch

from prime_comm.quant import BLOCK, LEVELS


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codebooks of shape (n_blocks, 256) float32, codes of shape (numel,) uint8)."""
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


def dequantize_ref(codebooks: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Decode: each code looks up its block's codebook (index_select)."""
    idx = torch.arange(codes.numel()) // BLOCK * LEVELS + codes.long()
    return codebooks.reshape(-1).index_select(0, idx)
