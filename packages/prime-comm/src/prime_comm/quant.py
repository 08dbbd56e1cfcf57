"""uint8 quantization of float32 CPU tensors (C++ kernels, blockwise codebooks).

Scheme: the flat tensor is cut into blocks of `BLOCK` (65536) elements. Each block's
[min, max] is split into 256 equal bins; an element's code is its bin, and the block's
codebook entry for a bin is the mean of the elements that fell into it. Encoded layout:
`[n_blocks x 256 float32 codebooks][numel uint8 codes]`, 1 + 1024/65536 bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime_comm import _kernels
from prime_comm._checks import check_float_tensor

BLOCK: int = _kernels.BLOCK
LEVELS: int = _kernels.LEVELS
_CODEBOOK_BYTES = LEVELS * 4
# Results at least this large come from the kernels' buffer cache (fresh memory faults in
# page by page at a cost close to the kernel's own); smaller ones from torch.empty.
_POOLED_BYTES = 1 << 20


def encoded_nbytes(numel: int) -> int:
    """Bytes of the encoding of `numel` floats (codebooks plus one code per element)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return _kernels.encoded_bytes(numel)


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized float32 tensor: `data` holds the encoding, `shape` the original shape."""

    data: torch.Tensor  # uint8, 1-D, encoded_nbytes(numel) bytes
    shape: torch.Size

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def num_blocks(self) -> int:
        return (self.numel + BLOCK - 1) // BLOCK

    @property
    def codebooks(self) -> torch.Tensor:
        """(num_blocks, 256) float32 view of the codebooks."""
        nb = self.num_blocks
        return self.data[: nb * _CODEBOOK_BYTES].view(torch.float32).view(nb, LEVELS)

    @property
    def codes(self) -> torch.Tensor:
        """(numel,) uint8 view of the codes."""
        return self.data[self.num_blocks * _CODEBOOK_BYTES :]


def set_num_threads(n: int) -> None:
    """Threads the kernels use (default: the CPUs this process may run on)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"thread count must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    _kernels.set_num_threads(n)


def get_num_threads() -> int:
    return _kernels.get_num_threads()


def set_buffer_cache_limit(nbytes: int) -> None:
    """Bytes of freed results that `quantize(x)` / `dequantize(q)` keep for reuse.

    Default 512 MiB; 0 returns them all to the system and disables the cache.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"cache limit must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"cache limit must be >= 0, got {nbytes}")
    _kernels.set_buffer_cache_limit(nbytes)


def _new_tensor(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor of `nbytes` bytes, pooled when large."""
    if nbytes < _POOLED_BYTES:
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype)
    # The tensor holds the Buffer (buffer protocol); when the last view dies, the memory goes
    # back to the cache. The tensor is writable and shares nothing with other results.
    return torch.frombuffer(_kernels.Buffer(nbytes), dtype=dtype)


def quantize(x: torch.Tensor, out: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize a contiguous float32 CPU tensor; NaN or Inf is a ValueError."""
    check_float_tensor(x, "x")
    nbytes = _kernels.encoded_bytes(x.numel())
    if out is None:
        out = _new_tensor(nbytes, torch.uint8)
    else:
        _check_encoded(out, nbytes, "out")
    if _kernels.quantize_many([(x.data_ptr(), x.numel(), out.data_ptr())]) >= 0:
        raise ValueError("x contains NaN or Inf; only finite values can be quantized")
    return QuantizedTensor(out, x.shape)


def dequantize(q: QuantizedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode `q` into a new tensor of its shape, or into `out` (same numel)."""
    out = _decode_target(q, out)
    _kernels.dequantize_many([(q.data.data_ptr(), q.numel, out.data_ptr())], False)
    return out


def dequantize_add_(out: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """Fused `out += dequantize(q)` without a temporary; returns `out`."""
    if out is None:
        raise TypeError("dequantize_add_ needs an out tensor to accumulate into")
    out = _decode_target(q, out)
    _kernels.dequantize_many([(q.data.data_ptr(), q.numel, out.data_ptr())], True)
    return out


def _decode_target(q: QuantizedTensor, out: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor (from quantize), got {type(q).__name__}")
    try:
        shape = torch.Size(q.shape)
    except (TypeError, ValueError) as e:
        raise TypeError(f"q.shape must be a sequence of ints, got {q.shape!r}") from e
    if any(s < 0 for s in shape):
        raise ValueError(f"q.shape must not hold negative sizes, got {tuple(shape)}")
    _check_encoded(q.data, _kernels.encoded_bytes(q.numel), "q.data")
    if out is None:
        return _new_tensor(4 * q.numel, torch.float32).view(shape)
    check_float_tensor(out, "out")
    if out.numel() != q.numel:
        raise ValueError(f"out has {out.numel()} elements but q encodes {q.numel}")
    return out


def _check_encoded(data: object, nbytes: int, what: str) -> None:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(data).__name__}")
    if data.dtype != torch.uint8 or data.device.type != "cpu" or data.layout != torch.strided:
        raise TypeError(f"{what} must be a uint8 CPU tensor, got {data.dtype} on {data.device}")
    if not data.is_contiguous() or data.dim() != 1:
        raise ValueError(f"{what} must be a contiguous 1-D tensor")
    if data.numel() != nbytes:
        raise ValueError(f"{what} holds {data.numel()} bytes, the encoding needs {nbytes}")
