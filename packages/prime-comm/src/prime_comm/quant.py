"""8-, 4- and 2-bit quantization of float32 CPU tensors (C++ kernels, blockwise codebooks).

The flat tensor is cut into blocks of `BLOCK` (65536) elements, each with its own codebook of
2^bits float32 entries. Encoded layout: `[n_blocks x 2^bits float32 codebooks][packed codes]`.

- bits=8: each block's [min, max] is split into 256 equal bins; an element's code is its
  bin, and the codebook entry for a bin is the mean of the elements that fell into it.
  1 + 1024/65536 bytes per element.
- bits=4 and 2: the codebook is the Lloyd-Max levels of a normal distribution scaled to the
  block (mean + std * level, clamped to [min, max]); an element's code is its nearest level.
  Codes are packed 2 or 4 to a byte: in groups of 32 (64) elements, byte j holds elements
  j, j + 16 (, j + 32, j + 48) from the low bits up; a final partial group is packed in order.
  0.5 + 64/65536 and 0.25 + 16/65536 bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime_comm import _kernels
from prime_comm._checks import check_bits, check_float_tensor

BLOCK: int = _kernels.BLOCK
LEVELS: int = _kernels.LEVELS  # of the default 8-bit codebook; 2**bits in general
BITS: tuple[int, ...] = tuple(_kernels.BITS)  # the supported code widths: 8, 4, 2
# Results at least this large come from the kernels' buffer cache (fresh memory faults in
# page by page at a cost close to the kernel's own); smaller ones from torch.empty.
_POOLED_BYTES = 1 << 20


def encoded_nbytes(numel: int, bits: int = 8) -> int:
    """Bytes of the encoding of `numel` floats at `bits` per code (codebooks plus codes):
    `ceil(numel / BLOCK) * 4 * 2**bits + ceil(numel * bits / 8)`."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return _kernels.encoded_bytes(numel, check_bits(bits))


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized float32 tensor: `data` holds the encoding, `shape` the original shape,
    `bits` the code width (8, 4 or 2)."""

    data: torch.Tensor  # uint8, 1-D, encoded_nbytes(numel, bits) bytes
    shape: torch.Size
    bits: int = 8

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
    def levels(self) -> int:
        """Entries per codebook: 2**bits."""
        return 1 << self.bits

    @property
    def codebooks(self) -> torch.Tensor:
        """(num_blocks, 2**bits) float32 view of the codebooks."""
        nb = self.num_blocks
        return self.data[: nb * 4 * self.levels].view(torch.float32).view(nb, self.levels)

    @property
    def codes(self) -> torch.Tensor:
        """uint8 view of the codes: one per element at 8 bits, packed below (module doc)."""
        return self.data[self.num_blocks * 4 * self.levels :]


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


def quantize(x: torch.Tensor, out: torch.Tensor | None = None, *, bits: int = 8) -> QuantizedTensor:
    """Quantize a contiguous float32 CPU tensor to `bits` (8, 4 or 2) per element; NaN or
    Inf is a ValueError. `out`: a uint8 buffer of `encoded_nbytes(x.numel(), bits)` to reuse."""
    check_float_tensor(x, "x")
    if isinstance(out, int) and not isinstance(out, bool):
        raise TypeError(f"out must be a uint8 tensor or None, got {out}; pass bits={out}")
    bits = check_bits(bits)
    nbytes = _kernels.encoded_bytes(x.numel(), bits)
    if out is None:
        out = _new_tensor(nbytes, torch.uint8)
    else:
        _check_encoded(out, nbytes, "out")
    if _kernels.quantize_many([(x.data_ptr(), x.numel(), out.data_ptr())], bits) >= 0:
        raise ValueError("x contains NaN or Inf; only finite values can be quantized")
    return QuantizedTensor(out, x.shape, bits)


def dequantize(q: QuantizedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode `q` (any width) into a new tensor of its shape, or into `out` (same numel)."""
    out = _decode_target(q, out)
    _kernels.dequantize_many([(q.data.data_ptr(), q.numel, out.data_ptr())], False, q.bits)
    return out


def dequantize_add_(out: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """Fused `out += dequantize(q)` without a temporary; returns `out`."""
    if out is None:
        raise TypeError("dequantize_add_ needs an out tensor to accumulate into")
    out = _decode_target(q, out)
    _kernels.dequantize_many([(q.data.data_ptr(), q.numel, out.data_ptr())], True, q.bits)
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
    bits = check_bits(q.bits)
    _check_encoded(q.data, _kernels.encoded_bytes(q.numel, bits), "q.data")
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
