import torch

from prime_comm import _kernels


def test_extension_reads_a_torch_buffer():
    x = torch.arange(10, dtype=torch.float32)
    assert _kernels.sum_f32(x.data_ptr(), x.numel()) == 45.0
