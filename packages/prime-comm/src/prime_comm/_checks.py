"""Input checks shared by the kernels' wrappers and the all-reduce.

The C++ kernels trust the buffers they are given, so everything that could make them read
out of bounds or produce garbage is rejected here with a message that names the fix.
"""

from __future__ import annotations

import torch

from prime_comm import _kernels


def tensor_problem(x: object, what: str = "tensor") -> Exception | None:
    """Why `x` is not a contiguous float32 CPU tensor (an exception to raise), or None."""
    if not isinstance(x, torch.Tensor):
        return TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if type(x).__name__ == "DTensor" or hasattr(x, "_local_tensor"):
        return TypeError(f"{what} is a DTensor; pass its local shard (x.to_local()) instead")
    if x.dtype != torch.float32:
        return TypeError(f"{what} must be float32, got {x.dtype}; convert it with .float()")
    if x.layout != torch.strided:
        return ValueError(f"{what} must be a dense (strided) tensor, got layout {x.layout}")
    if x.device.type != "cpu":
        return ValueError(
            f"{what} must be on the CPU, got device {x.device}; move it with .cpu() "
            "(and copy the result back)"
        )
    if not x.is_contiguous():
        return ValueError(f"{what} must be contiguous; pass x.contiguous() (and copy back)")
    return None


def check_float_tensor(x: object, what: str = "tensor") -> torch.Tensor:
    """Raise the problem found by `tensor_problem`, else return `x`."""
    problem = tensor_problem(x, what)
    if problem is not None:
        raise problem
    return x  # type: ignore[return-value]


def residual_problem(residual: object, tensor: torch.Tensor) -> Exception | None:
    """Why `residual` cannot receive `tensor`'s quantization error, or None."""
    problem = tensor_problem(residual, "residual")
    if problem is not None:
        return problem
    assert isinstance(residual, torch.Tensor)
    if residual.numel() != tensor.numel():
        return ValueError(
            f"residual has {residual.numel()} elements but tensor has {tensor.numel()}; "
            "pass a float32 buffer of the same length"
        )
    if residual.requires_grad:
        return ValueError("residual requires grad; pass residual.detach()")
    if residual.numel() and overlaps(residual, tensor):
        return ValueError(
            "residual shares memory with tensor; pass a separate buffer (it receives this "
            "rank's quantization error while tensor receives the result)"
        )
    return None


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + 4 * b.numel() and b0 < a0 + 4 * a.numel()


def check_bits(bits: object) -> int:
    """`bits` when it is a supported code width (8, 4 or 2); TypeError or ValueError else."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int (8, 4 or 2), got {type(bits).__name__}")
    if bits not in _kernels.BITS:
        raise ValueError(f"bits must be 8, 4 or 2, got {bits}")
    return bits
