"""prime_comm: uint8 quantization kernels and a compressed all-reduce over torch.distributed."""

from prime_comm import _kernels

__all__ = ["_kernels"]
__version__ = "0.1.0"
