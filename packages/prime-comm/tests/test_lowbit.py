"""The 4- and 2-bit quantizers: against the pure-torch reference, error bars, edge cases, the
packed layout, bit-identity across threads and SIMD levels, and bad input."""

from __future__ import annotations

import hashlib

import pytest
import torch

import prime_comm
from prime_comm import _kernels
from prime_comm.reference import (
    codes_ref,
    dequantize_ref,
    pack_codes_ref,
    quantize_ref,
    unpack_codes_ref,
)
from prime_testkit import available_simd_levels
from prime_testkit.fixed_data import pseudo_random

BLOCK = prime_comm.BLOCK
LOW = [4, 2]
# Empty, one, odd, around a packing group (32 / 64), around the block, several blocks.
SIZES = [0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1001]
SIZES += [BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 12345]
# Relative L2 round-trip error of Lloyd-Max quantization of a normal: 9.75% and 34.28%.
BARS = {4: 0.0985, 2: 0.345}


def test_encoded_size_formula():
    for n in SIZES:
        assert prime_comm.encoded_nbytes(n) == prime_comm.encoded_nbytes(n, bits=8)
        for bits in LOW:
            blocks = -(-n // BLOCK)
            expect = blocks * 4 * 2**bits + -(-n * bits // 8)
            assert prime_comm.encoded_nbytes(n, bits) == expect
    assert prime_comm.encoded_nbytes(1 << 20, 4) == (1 << 19) + 16 * 64
    assert prime_comm.encoded_nbytes(1 << 20, 2) == (1 << 18) + 16 * 16
    assert prime_comm.BITS == (8, 4, 2)


@pytest.mark.parametrize("bits", LOW)
@pytest.mark.parametrize("n", SIZES)
def test_matches_torch_reference(bits, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    q = prime_comm.quantize(x, bits=bits)
    assert q.bits == bits and q.levels == 2**bits
    assert q.nbytes == prime_comm.encoded_nbytes(n, bits)
    books, _ = quantize_ref(x, bits)
    assert q.codebooks.shape == books.shape == (-(-n // BLOCK), 2**bits)
    for xb, kb, rb in zip(x.split(BLOCK), q.codebooks, books, strict=False):
        sigma = xb.double().std(correction=0).item()
        assert (kb - rb).abs().max() <= 1e-5 * sigma + 1e-7  # sums rounded differently
        assert torch.all(kb[1:] >= kb[:-1])  # ascending
    codes = codes_ref(x, q.codebooks)  # the nearest level, exactly
    assert torch.equal(q.codes, pack_codes_ref(codes, bits))
    assert torch.equal(unpack_codes_ref(q.codes, n, bits), codes)
    y = prime_comm.dequantize(q)
    assert torch.equal(y, dequantize_ref(q.codebooks, codes))
    for xb, yb in zip(x.split(BLOCK), y.split(BLOCK), strict=True) if n else ():
        assert yb.min() >= xb.min() and yb.max() <= xb.max()  # inside the block's range


def test_packed_layout_by_hand():
    # 4 bits: byte j of a 32-element group holds elements j (low nibble) and j + 16 (high).
    x = torch.arange(35, dtype=torch.float32)
    q = prime_comm.quantize(x, bits=4)
    codes = unpack_codes_ref(q.codes, 35, 4)
    assert q.codes.numel() == 18  # 16 for the group, 2 for the 3-element tail
    assert q.codes[0] == codes[0] | codes[16] << 4
    assert q.codes[15] == codes[15] | codes[31] << 4
    assert q.codes[16] == codes[32] | codes[33] << 4 and q.codes[17] == codes[34]
    # 2 bits: byte j of a 64-element group holds elements j, j + 16, j + 32, j + 48.
    x = torch.arange(70, dtype=torch.float32)
    q = prime_comm.quantize(x, bits=2)
    c = unpack_codes_ref(q.codes, 70, 2).int()
    assert q.codes.numel() == 16 + 2
    assert q.codes[3] == c[3] | c[19] << 2 | c[35] << 4 | c[51] << 6
    assert q.codes[16] == c[64] | c[65] << 2 | c[66] << 4 | c[67] << 6
    assert q.codes[17] == c[68] | c[69] << 2  # unused high bits are zero


@pytest.mark.parametrize("bits", LOW)
def test_round_trip_error_on_standard_normal(bits):
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
    y = prime_comm.dequantize(prime_comm.quantize(x, bits=bits))
    rel = ((y - x).norm() / x.norm()).item()
    assert rel <= BARS[bits], f"{bits}-bit round-trip relative L2 error {rel:.4%}"
    # Scale and offset do not matter: the codebook follows the block's mean and spread.
    z = x * 1e-3 + 5e-3
    w = prime_comm.dequantize(prime_comm.quantize(z, bits=bits))
    assert ((w - z).norm() / (z - 5e-3).norm()).item() <= BARS[bits] * 1.01


@pytest.mark.parametrize("bits", LOW)
def test_error_on_other_distributions(bits):
    # Heavier tails than a normal cost accuracy (measured; these bars leave a little room).
    g = torch.Generator().manual_seed(1)
    bars = {4: {"laplace": 0.18, "cubed": 0.48}, 2: {"laplace": 0.45, "cubed": 0.73}}
    u = torch.rand(1 << 20, generator=g) - 0.5
    inputs = {
        "laplace": -u.sign() * torch.log1p(-2 * u.abs()),
        "cubed": torch.randn(1 << 20, generator=g) ** 3,
    }
    for name, x in inputs.items():
        y = prime_comm.dequantize(prime_comm.quantize(x, bits=bits))
        rel = ((y - x).norm() / x.norm()).item()
        assert rel <= bars[bits][name], (name, rel)


@pytest.mark.parametrize("bits", LOW)
@pytest.mark.parametrize("value", [0.0, 0.1, -3.3e38, 1e-42])
def test_constant_tensor_round_trips_exactly(bits, value):
    x = torch.full((BLOCK + 5,), value)
    assert torch.equal(prime_comm.dequantize(prime_comm.quantize(x, bits=bits)), x)


@pytest.mark.parametrize("bits", LOW)
def test_small_and_two_valued_inputs(bits):
    for x in ([1.5], [-2.0, 7.0], [0.0, 0.0, 1.0], [4.0, -1.0] * 50):
        t = torch.tensor(x)
        y = prime_comm.dequantize(prime_comm.quantize(t, bits=bits))
        assert torch.equal(y, t), (x, y)  # the clamped extreme levels hit min and max


@pytest.mark.parametrize("bits", LOW)
def test_extreme_ranges_stay_finite_and_bounded(bits):
    # Sums overflow float here: the block goes through the double fallback.
    x = torch.tensor([-3.4e38, 3.4e38, 0.0, 1.0] * 1000)
    y = prime_comm.dequantize(prime_comm.quantize(x, bits=bits))
    assert torch.isfinite(y).all() and y.min() >= x.min() and y.max() <= x.max()
    assert y[0] == x[0] and y[1] == x[1]
    big = torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 1e30
    w = prime_comm.dequantize(prime_comm.quantize(big, bits=bits))
    assert ((w - big).double().norm() / big.double().norm()).item() <= BARS[bits] * 1.01
    tiny = torch.tensor([0.0, 1e-45, 2e-45, 5e-45] * 100)
    t = prime_comm.dequantize(prime_comm.quantize(tiny, bits=bits))
    assert torch.isfinite(t).all() and t.min() >= 0 and t.max() <= 5e-45


def test_output_identical_for_any_thread_count_and_simd_path():
    x = torch.randn(7 * BLOCK + 999, generator=torch.Generator().manual_seed(7))
    x[BLOCK : BLOCK + 3] = torch.tensor([-0.0, 0.0, -0.0])
    x[2 * BLOCK : 3 * BLOCK] = 0.25  # a constant block
    base = torch.randn(x.numel(), generator=torch.Generator().manual_seed(8))
    before = prime_comm.get_num_threads()
    simd = _kernels.simd()
    try:
        for bits in LOW:
            results = []
            for level in available_simd_levels():
                _kernels.set_simd(level)
                for threads in (1, 2, 3, 8):
                    prime_comm.set_num_threads(threads)
                    q = prime_comm.quantize(x, bits=bits)
                    acc = base.clone()
                    prime_comm.dequantize_add_(acc, q)
                    results.append((q.data.clone(), prime_comm.dequantize(q), acc))
            for data, y, acc in results[1:]:
                assert torch.equal(data, results[0][0]) and torch.equal(y, results[0][1])
                assert torch.equal(acc, results[0][2])
            assert torch.equal(results[0][2], base + results[0][1])
    finally:
        prime_comm.set_num_threads(before)
        _kernels.set_simd(simd)


@pytest.mark.parametrize(
    "bits, name, digest",
    [
        (4, "uniform", "632dcfd9948dc88c72647e345c945d2a5918ac8196b0b4920ac48cca64f19779"),
        (4, "cubed", "fe6f8651466c67732a8ec5aae53b405d4a57b56d7c5b47c3d4a0c59c5412b498"),
        (2, "uniform", "8d0967a08253da364189ba4d7b5bf016fa05ce15bbe83bd18857b20245c41ef3"),
        (2, "cubed", "aca537804a41a948bba8bfa91f27d5a60a9ec44715d3d29733fa4386e1546b97"),
    ],
)
def test_wire_bytes_unchanged(bits, name, digest):
    # Digests of the encoding written by the first release of the 4- and 2-bit kernels:
    # peers running different versions must exchange the same bytes.
    u = pseudo_random(3 * BLOCK + 12345)
    x = u if name == "uniform" else u * u * u * 8
    simd = _kernels.simd()
    try:
        for level in available_simd_levels():
            _kernels.set_simd(level)
            data = prime_comm.quantize(x, bits=bits).data.numpy().tobytes()
            assert hashlib.sha256(data).hexdigest() == digest, level
    finally:
        _kernels.set_simd(simd)


@pytest.mark.parametrize("bits", LOW)
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_large_outputs_streamed_equal_the_cached_path(bits, offset):
    # 20 MiB of output, above the streaming threshold; an offset view is not 64-byte
    # aligned, so it takes plain stores.
    n = 5 * (1 << 20) + 3
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    q = prime_comm.quantize(x, bits=bits)
    out = torch.full((n + offset,), float("nan"))[offset:]
    prime_comm.dequantize(q, out=out)
    assert torch.equal(out, dequantize_ref(q.codebooks, unpack_codes_ref(q.codes, n, bits)))
    head = prime_comm.quantize(x[: 4 * BLOCK], bits=bits)  # small: the cached-store path
    assert torch.equal(out[: 4 * BLOCK], prime_comm.dequantize(head))


@pytest.mark.parametrize("bits", [8, *LOW])
def test_shape_out_and_fused_accumulate(bits):
    """Every width (uint8 included): shapes, `out=`, the fused accumulate, pooled buffers."""
    x = torch.randn(300, 701)
    q = prime_comm.quantize(x, bits=bits)
    y = prime_comm.dequantize(q)
    assert y.shape == x.shape
    out = torch.empty(300 * 701)
    assert prime_comm.dequantize(q, out=out) is out and torch.equal(out, y.reshape(-1))
    base = torch.randn(300, 701)
    acc = base.clone()
    assert prime_comm.dequantize_add_(acc, q) is acc
    assert torch.equal(acc, base + y)
    buf = torch.empty(prime_comm.encoded_nbytes(x.numel(), bits), dtype=torch.uint8)
    q2 = prime_comm.quantize(x, out=buf, bits=bits)
    assert q2.data is buf and torch.equal(q2.data, q.data) and q2.bits == bits
    big = torch.randn((1 << 20) + 5)  # pooled result buffers
    assert torch.equal(
        prime_comm.dequantize(prime_comm.quantize(big, bits=bits)),
        prime_comm.dequantize(prime_comm.quantize(big, out=None, bits=bits)),
    )


@pytest.mark.parametrize("bits", LOW)
@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: torch.randn(10).double(), TypeError, "float32"),
        (lambda: torch.randn(10, 2)[:, 0], ValueError, "contiguous"),
        (lambda: torch.empty(10, device="meta"), ValueError, "CPU"),
        (lambda: torch.randn(4, 4).to_sparse(), ValueError, "dense"),
        (lambda: torch.tensor([1.0, float("nan")]), ValueError, "NaN"),
        (lambda: torch.tensor([float("inf")] + [1.0] * 100), ValueError, "NaN or Inf"),
        (lambda: torch.tensor([1.0] * 100 + [float("-inf")]), ValueError, "NaN or Inf"),
        (lambda: torch.tensor([3e38, float("inf"), -3e38]), ValueError, "NaN or Inf"),
    ],
)
def test_quantize_rejects_bad_input(bits, make, exc, words):
    with pytest.raises(exc, match=words):
        prime_comm.quantize(make(), bits=bits)


def test_bad_bits_and_mismatched_encodings():
    x = torch.randn(100)
    for bits in (3, 1, 16, 0, -4):
        with pytest.raises(ValueError, match="8, 4 or 2"):
            prime_comm.quantize(x, bits=bits)
        with pytest.raises(ValueError, match="8, 4 or 2"):
            prime_comm.encoded_nbytes(10, bits)
    for bits in ("4", 4.0, True, None):
        with pytest.raises(TypeError, match="bits must be an int"):
            prime_comm.quantize(x, bits=bits)
    with pytest.raises(TypeError, match="bits=4"):
        prime_comm.quantize(x, 4)  # bits is keyword-only: the second argument is `out`
    q = prime_comm.quantize(x, bits=4)
    with pytest.raises(ValueError, match="8, 4 or 2"):
        prime_comm.dequantize(prime_comm.QuantizedTensor(q.data, q.shape, 3))
    with pytest.raises(ValueError, match="bytes"):  # 4-bit bytes read as 2-bit or 8-bit
        prime_comm.dequantize(prime_comm.QuantizedTensor(q.data, q.shape, 2))
    with pytest.raises(ValueError, match="bytes"):
        prime_comm.dequantize(prime_comm.QuantizedTensor(q.data, q.shape))
    with pytest.raises(ValueError, match="bytes"):
        prime_comm.dequantize(prime_comm.QuantizedTensor(q.data[:-1], q.shape, 4))
    with pytest.raises(ValueError, match="bytes"):  # an 8-bit sized buffer for 4 bits
        prime_comm.quantize(x, out=torch.empty(1124, dtype=torch.uint8), bits=4)
    with pytest.raises(TypeError, match="uint8"):
        prime_comm.dequantize(prime_comm.QuantizedTensor(q.data.float(), q.shape, 4))
    with pytest.raises(ValueError, match="elements"):
        prime_comm.dequantize(q, out=torch.empty(99))
    with pytest.raises(ValueError):
        _kernels.quantize_many([], 3)
