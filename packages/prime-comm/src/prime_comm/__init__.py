"""prime_comm: 8/4/2-bit quantization kernels and a compressed all-reduce over torch.distributed."""

from prime_comm.allreduce import AllReduceStats, all_reduce, ring_bytes
from prime_comm.encoded import EncodedResult
from prime_comm.errors import CollectiveAborted
from prime_comm.quant import (
    BITS,
    BLOCK,
    LEVELS,
    QuantizedTensor,
    dequantize,
    dequantize_add_,
    encoded_nbytes,
    get_num_threads,
    quantize,
    set_buffer_cache_limit,
    set_num_threads,
)

__all__ = [
    "BITS",
    "BLOCK",
    "LEVELS",
    "AllReduceStats",
    "CollectiveAborted",
    "EncodedResult",
    "QuantizedTensor",
    "all_reduce",
    "dequantize",
    "dequantize_add_",
    "encoded_nbytes",
    "get_num_threads",
    "quantize",
    "ring_bytes",
    "set_buffer_cache_limit",
    "set_num_threads",
]
__version__ = "0.1.0"
