"""prime-comm's kernels seen from a test: the SIMD levels this CPU can run."""

from __future__ import annotations

# prime_comm._kernels' levels, lowest first
SIMD_LEVELS = ["scalar", "avx2", "avx512"]


def available_simd_levels() -> list[str]:
    """The SIMD levels this CPU runs (`_kernels.set_simd` accepts), lowest first."""
    from prime_comm import _kernels

    return SIMD_LEVELS[: SIMD_LEVELS.index(_kernels.cpu_simd()) + 1]
