// Decoding: every code looks up its block's 256-entry codebook.
//
// The portable path is a plain load-load-store loop (on the CPUs measured it beats AVX2's
// gather, so the AVX2 level uses it too). With AVX-512 VBMI the codebook is split into four
// 256-byte planes (byte k of every entry) held in 16 registers, and 64 codes are looked up at
// once with two-table byte permutes, then the planes are interleaved back into floats.
// Large outputs can be written with streaming stores, which skip reading the destination's
// old contents into the cache (a third of the memory traffic of a plain store). Every path
// writes the same values.
#pragma once

#include <cstdint>
#include <cstring>

#include "quant.h"
#include "simd.h"

namespace prime_comm {

template <int Mode>  // 0: out = cb[c], 1: out += cb[c]
inline void decode_portable(const float* __restrict cb, const uint8_t* __restrict codes,
                            int64_t n, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = cb[codes[i]];
    if (Mode == 0) {
      out[i] = v;
    } else {
      out[i] = out[i] + v;
    }
  }
}

#if PRIME_COMM_X86
#define PRIME_COMM_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))

// stream: write with non-temporal stores (Mode 0 only); the caller fences.
template <int Mode>
PRIME_COMM_VBMI void decode_avx512(const float* cb, const uint8_t* codes, int64_t n, float* out,
                                   bool stream) {
  // planes[p] holds byte p of the 256 entries, as four 64-byte tables.
  __m512i planes[4][4];
  for (int q = 0; q < 4; ++q) {
    __m512i v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm512_loadu_si512(cb + 64 * q + 16 * k);
    for (int p = 0; p < 4; ++p) {
      const __m128i b0 = _mm512_cvtepi32_epi8(_mm512_srli_epi32(v[0], 8 * p));
      const __m128i b1 = _mm512_cvtepi32_epi8(_mm512_srli_epi32(v[1], 8 * p));
      const __m128i b2 = _mm512_cvtepi32_epi8(_mm512_srli_epi32(v[2], 8 * p));
      const __m128i b3 = _mm512_cvtepi32_epi8(_mm512_srli_epi32(v[3], 8 * p));
      __m512i t = _mm512_castsi128_si512(b0);
      t = _mm512_inserti32x4(t, b1, 1);
      t = _mm512_inserti32x4(t, b2, 2);
      planes[p][q] = _mm512_inserti32x4(t, b3, 3);
    }
  }
  int64_t i = 0;
  if (stream) {  // streaming stores need 64-byte aligned addresses
    const int64_t head = ((64 - reinterpret_cast<std::uintptr_t>(out) % 64) % 64) / 4;
    i = reinterpret_cast<std::uintptr_t>(out) % 4 == 0 ? std::min(head, n) : n;
    decode_portable<Mode>(cb, codes, i, out);
  }
  for (; i + 64 <= n; i += 64) {
    const __m512i c = _mm512_loadu_si512(codes + i);
    const __mmask64 upper = _mm512_movepi8_mask(c);  // code >= 128: tables 2 and 3
    __m512i b[4];
    for (int p = 0; p < 4; ++p) {
      const __m512i lo = _mm512_permutex2var_epi8(planes[p][0], c, planes[p][1]);
      const __m512i hi = _mm512_permutex2var_epi8(planes[p][2], c, planes[p][3]);
      b[p] = _mm512_mask_blend_epi8(upper, lo, hi);
    }
    // Interleave the planes into floats: within each 128-bit lane L, r0..r3 hold elements
    // 16L + 0..3, 4..7, 8..11, 12..15; then regroup the lanes into element order.
    const __m512i b01l = _mm512_unpacklo_epi8(b[0], b[1]), b01h = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i b23l = _mm512_unpacklo_epi8(b[2], b[3]), b23h = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i r0 = _mm512_unpacklo_epi16(b01l, b23l), r1 = _mm512_unpackhi_epi16(b01l, b23l);
    const __m512i r2 = _mm512_unpacklo_epi16(b01h, b23h), r3 = _mm512_unpackhi_epi16(b01h, b23h);
    const __m512i a01 = _mm512_shuffle_i64x2(r0, r1, 0x44), a23 = _mm512_shuffle_i64x2(r2, r3, 0x44);
    const __m512i c01 = _mm512_shuffle_i64x2(r0, r1, 0xEE), c23 = _mm512_shuffle_i64x2(r2, r3, 0xEE);
    __m512 o[4] = {_mm512_castsi512_ps(_mm512_shuffle_i64x2(a01, a23, 0x88)),
                   _mm512_castsi512_ps(_mm512_shuffle_i64x2(a01, a23, 0xDD)),
                   _mm512_castsi512_ps(_mm512_shuffle_i64x2(c01, c23, 0x88)),
                   _mm512_castsi512_ps(_mm512_shuffle_i64x2(c01, c23, 0xDD))};
    for (int k = 0; k < 4; ++k) {
      if (Mode == 1) {
        _mm512_storeu_ps(out + i + 16 * k, _mm512_add_ps(_mm512_loadu_ps(out + i + 16 * k), o[k]));
      } else if (stream) {
        _mm512_stream_ps(out + i + 16 * k, o[k]);
      } else {
        _mm512_storeu_ps(out + i + 16 * k, o[k]);
      }
    }
  }
  decode_portable<Mode>(cb, codes + i, n - i, out + i);
}

inline void store_fence() { _mm_sfence(); }
#else
inline void store_fence() {}
#endif

// Decodes one block. stream: the caller's output is too large to stay in the cache anyway
// (Mode 0 only), so write around it; call store_fence() before the output is handed on.
template <int Mode>
inline void decode_block(const float* cb, const uint8_t* codes, int64_t n, float* out,
                         bool stream = false) {
#if PRIME_COMM_X86
  if (simd_level() == Simd::kAvx512) {
    decode_avx512<Mode>(cb, codes, n, out, Mode == 0 && stream);
    return;
  }
#endif
  (void)stream;
  decode_portable<Mode>(cb, codes, n, out);
}

inline void divide_block(float* out, int64_t n, float divisor) {
  for (int64_t i = 0; i < n; ++i) out[i] = out[i] / divisor;
}

}  // namespace prime_comm
