"""The C++ quantizer against a pure-torch reference, plus edge cases and bad input."""

from __future__ import annotations

import faulthandler
import hashlib
import os
import time

import pytest
import torch

import prime_comm
from prime_comm import _kernels
from prime_comm.reference import dequantize_ref as ref_decode
from prime_comm.reference import quantize_ref as ref_quantize
from prime_testkit import available_simd_levels
from prime_testkit.fixed_data import pseudo_random

BLOCK = prime_comm.BLOCK


SIZES = [0, 1, 2, 31, 32, 33, 1000, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 12345]


@pytest.mark.parametrize("n", SIZES)
def test_matches_torch_reference(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    q = prime_comm.quantize(x)
    books, codes = ref_quantize(x)
    assert q.nbytes == prime_comm.encoded_nbytes(n) == books.numel() * 4 + n
    assert torch.equal(q.codes, codes)
    # The codebook is the bin mean to 1/65536 of a bin width: compare within that.
    width = (books.amax(1) - books.amin(1)).clamp(min=1e-30) / 256 if n else torch.zeros(0)
    assert torch.all((q.codebooks - books).abs() <= width[:, None] * 1e-3 + 1e-6)
    y = prime_comm.dequantize(q)
    assert torch.equal(y, ref_decode(q.codebooks, q.codes))
    if n:
        # Every element decodes within one bin width of its value.
        for xb, yb in zip(x.split(BLOCK), y.split(BLOCK), strict=True):
            assert (xb - yb).abs().max() <= (xb.max() - xb.min()) / 256 * 1.0001


def test_round_trip_error_on_standard_normal():
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
    y = prime_comm.dequantize(prime_comm.quantize(x))
    rel = ((y - x).norm() / x.norm()).item()
    assert rel <= 0.012, f"round-trip relative L2 error {rel:.4%} > 1.2%"


@pytest.mark.parametrize("value", [0.0, 0.1, -3.3e38, 1e-42])
def test_constant_tensor_round_trips_exactly(value):
    x = torch.full((BLOCK + 5,), value)
    assert torch.equal(prime_comm.dequantize(prime_comm.quantize(x)), x)


def test_extreme_ranges_stay_finite_and_bounded():
    x = torch.tensor([-3.4e38, 3.4e38, 0.0, 1.0] * 1000)
    y = prime_comm.dequantize(prime_comm.quantize(x))
    assert torch.isfinite(y).all() and y.min() >= x.min() and y.max() <= x.max()
    tiny = torch.tensor([0.0, 1e-45, 2e-45, 5e-45] * 100)  # bins narrower than a float step
    assert torch.equal(prime_comm.dequantize(prime_comm.quantize(tiny)), tiny)


def test_output_identical_for_any_thread_count_and_simd_path():
    x = torch.randn(7 * BLOCK + 999, generator=torch.Generator().manual_seed(7))
    base = torch.randn(x.numel(), generator=torch.Generator().manual_seed(8))
    before = prime_comm.get_num_threads()
    simd = _kernels.simd()
    results = []
    try:
        for level in available_simd_levels():
            _kernels.set_simd(level)
            for threads in (1, 2, 3, 8):
                prime_comm.set_num_threads(threads)
                q = prime_comm.quantize(x)
                acc = base.clone()
                prime_comm.dequantize_add_(acc, q)
                results.append((q.data.clone(), prime_comm.dequantize(q), acc))
    finally:
        prime_comm.set_num_threads(before)
        _kernels.set_simd(simd)
    for data, y, acc in results[1:]:
        assert torch.equal(data, results[0][0]) and torch.equal(y, results[0][1])
        assert torch.equal(acc, results[0][2])


@pytest.mark.parametrize(
    "name, digest",
    [
        ("uniform", "aa56621193ebc4684c070d135c83da5dd6d0ef5390965e210436ee5abcb9c9c0"),
        ("cubed", "8cb031a8cfa0b4efd1304ac29d4b29858325859d5cd0c1ed34befb88bf427b90"),
    ],
)
def test_wire_bytes_unchanged(name, digest):
    # Digests of the encoding written by the first released kernels (before the issue-16
    # speed-ups): peers running either version exchange the same bytes.
    u = pseudo_random(3 * BLOCK + 12345)
    x = u if name == "uniform" else u * u * u * 8
    simd = _kernels.simd()
    try:
        for level in available_simd_levels():
            _kernels.set_simd(level)
            data = prime_comm.quantize(x).data.numpy().tobytes()
            assert hashlib.sha256(data).hexdigest() == digest, level
    finally:
        _kernels.set_simd(simd)


def test_signed_zeros_encode_alike_on_every_simd_level():
    # Which zero a vector min keeps depends on the comparison order; the bounds are made +0.
    x = torch.zeros(3 * BLOCK + 100)
    x[::3] = -0.0
    x[BLOCK : 2 * BLOCK] = torch.randn(BLOCK).abs()
    x[BLOCK + 5 :: 7] = -0.0
    simd = _kernels.simd()
    encodings = []
    try:
        for level in available_simd_levels():
            _kernels.set_simd(level)
            encodings.append(prime_comm.quantize(x).data.clone())
    finally:
        _kernels.set_simd(simd)
    assert all(torch.equal(e, encodings[0]) for e in encodings[1:])
    y = prime_comm.dequantize(prime_comm.QuantizedTensor(encodings[0], x.shape))
    assert torch.equal(y[:BLOCK], x[:BLOCK])  # a block of zeros decodes to zeros


@pytest.mark.parametrize("offset", [0, 1, 5])
def test_large_outputs_streamed_equal_the_cached_path(offset):
    # 5M elements: 20 MiB of output, above the streaming threshold; an offset view is not
    # 64-byte aligned, so the aligned streaming stores start after a few plain ones.
    n = 5 * (1 << 20) + 3
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    q = prime_comm.quantize(x)
    out = torch.full((n + offset,), float("nan"))[offset:]
    prime_comm.dequantize(q, out=out)
    pieces = torch.cat([prime_comm.dequantize(p) for p in _split(q, 4 * BLOCK)])
    assert torch.equal(out, pieces)  # small calls take the cached-store path
    assert torch.equal(out, ref_decode(q.codebooks, q.codes))


def _split(q, size):
    """The encodings of consecutive slices of q's tensor, cut at block boundaries."""
    books, codes = q.codebooks, q.codes
    parts = []
    for start in range(0, q.numel, size):
        b0, b1 = start // BLOCK, -(-min(start + size, q.numel) // BLOCK)
        data = torch.cat([books[b0:b1].reshape(-1).view(torch.uint8), codes[start : start + size]])
        parts.append(
            prime_comm.QuantizedTensor(data, torch.Size([data.numel() - (b1 - b0) * 1024]))
        )
    return parts


@pytest.mark.parametrize("n", [1000, BLOCK + 7, (1 << 20) + 5])
def test_allocating_forms_equal_the_out_forms(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    buf = torch.empty(prime_comm.encoded_nbytes(n), dtype=torch.uint8)
    q_out = prime_comm.quantize(x, out=buf)
    q = prime_comm.quantize(x)
    assert torch.equal(q.data, q_out.data) and q.data.dtype == torch.uint8
    y = prime_comm.dequantize(q)
    out = torch.empty(n)
    assert torch.equal(y, prime_comm.dequantize(q_out, out=out))
    assert y.dtype == torch.float32 and y.is_contiguous() and y.shape == x.shape


def test_freed_results_are_reused_within_the_cache_limit():
    x = torch.randn(1 << 20)
    nbytes = 4 * x.numel()
    try:
        prime_comm.set_buffer_cache_limit(0)  # start from an empty cache
        prime_comm.set_buffer_cache_limit(64 << 20)
        y = prime_comm.dequantize(prime_comm.quantize(x))
        first = y.data_ptr()
        view = y[10:]
        del y
        assert _kernels.cached_buffer_bytes() < nbytes  # a view still holds the memory
        expected = view.clone()
        del view
        assert _kernels.cached_buffer_bytes() >= nbytes
        y2 = prime_comm.dequantize(prime_comm.quantize(x))
        assert y2.data_ptr() == first  # the freed buffer came back
        assert torch.equal(y2[10:], expected)
        y3 = prime_comm.dequantize(prime_comm.quantize(x))
        assert y3.data_ptr() != y2.data_ptr()  # a live result is never handed out twice
        del y2, y3
        prime_comm.set_buffer_cache_limit(nbytes)  # keeps at most one of the two
        assert 0 < _kernels.cached_buffer_bytes() <= nbytes + (2 << 20)
        prime_comm.set_buffer_cache_limit(0)
        assert _kernels.cached_buffer_bytes() == 0
        y4 = prime_comm.dequantize(prime_comm.quantize(x))
        del y4
        assert _kernels.cached_buffer_bytes() == 0  # limit 0: nothing is kept
    finally:
        prime_comm.set_buffer_cache_limit(512 << 20)


def test_kernels_work_in_a_forked_child():
    prime_comm.set_num_threads(2)
    x = torch.randn(4 * BLOCK)
    expected = bytes(prime_comm.quantize(x).data.numpy())  # the pool's threads now exist
    pid = os.fork()
    if pid == 0:  # the child has no pool threads: it must build its own, not hang.
        # (No torch ops here: torch's own OpenMP pool is not fork-safe.)
        faulthandler.dump_traceback_later(30, exit=True)
        ok = bytes(prime_comm.quantize(x).data.numpy()) == expected
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("quantize hung in a forked child")


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: torch.randn(10).double(), TypeError, "float32"),
        (lambda: torch.arange(10), TypeError, "float32"),
        (lambda: [1.0, 2.0], TypeError, "torch.Tensor"),
        (lambda: torch.randn(10, 2)[:, 0], ValueError, "contiguous"),
        (lambda: torch.randn(10, 2).t(), ValueError, "contiguous"),
        (lambda: torch.empty(10, device="meta"), ValueError, "CPU"),
        (lambda: torch.randn(4, 4).to_sparse(), ValueError, "dense"),
        (lambda: torch.tensor([1.0, float("nan")]), ValueError, "NaN"),
        (lambda: torch.tensor([float("-inf"), 1.0]), ValueError, "NaN or Inf"),
    ],
)
def test_quantize_rejects_bad_input(make, exc, words):
    with pytest.raises(exc, match=words):
        prime_comm.quantize(make())


def test_dequantize_and_settings_reject_bad_input():
    q = prime_comm.quantize(torch.randn(100))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        prime_comm.dequantize(q.data)
    with pytest.raises(ValueError, match="elements"):
        prime_comm.dequantize(q, out=torch.empty(99))
    with pytest.raises(TypeError, match="float32"):
        prime_comm.dequantize(q, out=torch.empty(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="bytes"):
        prime_comm.dequantize(prime_comm.QuantizedTensor(q.data[:-1], q.shape))
    with pytest.raises(TypeError, match="uint8"):
        prime_comm.dequantize(prime_comm.QuantizedTensor(q.data.float(), q.shape))
    with pytest.raises(ValueError, match="negative"):
        prime_comm.dequantize(prime_comm.QuantizedTensor(q.data, torch.Size([-1])))
    with pytest.raises(ValueError, match="bytes"):
        prime_comm.quantize(torch.randn(100), out=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match=">= 1"):
        prime_comm.set_num_threads(0)
    with pytest.raises(TypeError, match="int"):
        prime_comm.set_num_threads("2")
    with pytest.raises(ValueError, match=">= 0"):
        prime_comm.set_buffer_cache_limit(-1)
    with pytest.raises(TypeError, match="int"):
        prime_comm.set_buffer_cache_limit(1.5)
    with pytest.raises(ValueError, match="avx2"):
        _kernels.set_simd("sse9")
