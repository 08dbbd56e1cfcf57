// Blockwise 4-bit and 2-bit quantization with a Gaussian-shaped codebook per block.
//
// Encoding of n floats with B bits (L = 2^B levels), the same shape as the uint8 one:
//   [nb codebooks of L float32][ceil(n * B / 8) bytes of packed codes], nb = ceil(n / kBlock),
// block k's codes starting at byte k * kBlock * B / 8 of the code area.
//
// Codebook of a block: y_j = clamp(mu + sigma * z_j, lo, hi), rounded to float, where mu and
// sigma are the block's mean and (population) standard deviation, lo and hi its min and max,
// and z_j the Lloyd-Max levels of a standard normal (the levels with the least mean squared
// error for Gaussian data: 9.75% relative L2 at 4 bits, 34.3% at 2). The clamp keeps every
// decoded value inside the block's range and decodes a constant block exactly.
// Code of x: its nearest level, decided against the float midpoints of adjacent levels
// (x >= midpoint(y_j, y_j+1) means at least j + 1), found by a branch-free binary search.
//
// Packing: groups of G = 128 / B elements (32 or 64) fill 16 bytes; byte j of a group holds
// elements j, j + 16 (and j + 32, j + 48 at 2 bits) from the low bits up, so the vector code
// packs and unpacks with shifts only. A final partial group (the last n % G elements) is
// packed in order: element i at byte i * B / 8, bit (i * B) % 8, unused high bits zero.
//
// Determinism: mu and sigma come from sums in fixed lanes and a fixed order in every code path
// (see the block statistics), with no FMA contraction, so every thread count and SIMD level
// writes the same bytes.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "quant.h"
#include "simd.h"

namespace prime_comm {
namespace lowbit {

// The positive half of the Lloyd-Max levels of N(0, 1) (the negative half mirrors it).
constexpr double kNormal4[8] = {0.12839502985114704, 0.38804829949029063, 0.65675911853246327,
                                0.94234045648696196, 1.2562311973471756,  1.6180463860218808,
                                2.0690172265313875,  2.7325895709951631};
constexpr double kNormal2[2] = {0.45278003463649208, 1.5104176084990959};

template <int Bits>
constexpr int kL = 1 << Bits;
template <int Bits>
constexpr int64_t kGroup = 128 / Bits;  // elements per 16-byte group

template <int Bits>
inline double normal_level(int j) {
  constexpr int half = kL<Bits> / 2;
  const double* h = Bits == 4 ? kNormal4 : kNormal2;
  return j >= half ? h[j - half] : -h[half - 1 - j];
}

// ---- block statistics: min, max and the moments about x[0] ---------------------------------
//
// Sums of d = x - x[0] and d * d in float, in 32 fixed lanes (element i of the block goes to
// lane i % 32, in order), each lane flushed into a double every kChunk elements; then a fixed
// pairwise reduction. Every code path performs exactly these float and double operations, so
// the sums (and the bytes) are identical on every SIMD level. Taking the moments about an
// element of the block bounds the cancellation in var = E[d^2] - E[d]^2: |x[0] - mean| is at
// most sqrt(n) standard deviations. A sum that overflows float (|x| beyond ~1e18) sends the
// block through a plain double loop instead.

constexpr int kLanes = 32;
constexpr int64_t kChunk = 2048;

struct Moments {
  alignas(64) double s1[kLanes];
  alignas(64) double s2[kLanes];
  float lo = FLT_MAX, hi = -FLT_MAX;
};

struct Lanes {  // one chunk's float lanes
  alignas(64) float f1[kLanes];
  alignas(64) float f2[kLanes];
};

// Elements [i0, n) of a chunk in scalar code (the SIMD paths' tails).
inline void lanes_scalar(const float* x, int64_t i0, int64_t n, float x0, Lanes* f, float* lo,
                         float* hi) {
  for (int64_t i = i0; i < n; ++i) {
    const float v = x[i];
    *lo = v < *lo ? v : *lo;
    *hi = v > *hi ? v : *hi;
    const float d = v - x0;
    f->f1[i & (kLanes - 1)] += d;
    f->f2[i & (kLanes - 1)] += d * d;
  }
}

inline void lanes_portable(const float* x, int64_t n, float x0, Lanes* f, float* lo,
                           float* hi) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {  // the same order, in a shape the compiler vectorises
    for (int l = 0; l < kLanes; ++l) {
      const float d = x[i + l] - x0;
      f->f1[l] += d;
      f->f2[l] += d * d;
    }
    for (int l = 0; l < kLanes; ++l) {
      *lo = x[i + l] < *lo ? x[i + l] : *lo;
      *hi = x[i + l] > *hi ? x[i + l] : *hi;
    }
  }
  lanes_scalar(x, i, n, x0, f, lo, hi);
}

#if PRIME_COMM_X86
__attribute__((target("avx2"))) inline void lanes_avx2(const float* x, int64_t n, float x0,
                                                       Lanes* f, float* lo_out, float* hi_out) {
  const __m256 c = _mm256_set1_ps(x0);
  __m256 a[4], q[4];
  for (int k = 0; k < 4; ++k) a[k] = q[k] = _mm256_setzero_ps();
  __m256 lo = _mm256_set1_ps(*lo_out), hi = _mm256_set1_ps(*hi_out);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * k);
      lo = _mm256_min_ps(lo, v);
      hi = _mm256_max_ps(hi, v);
      const __m256 d = _mm256_sub_ps(v, c);
      a[k] = _mm256_add_ps(a[k], d);
      q[k] = _mm256_add_ps(q[k], _mm256_mul_ps(d, d));
    }
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_store_ps(f->f1 + 8 * k, a[k]);
    _mm256_store_ps(f->f2 + 8 * k, q[k]);
  }
  alignas(32) float l[8], h[8];
  _mm256_store_ps(l, lo);
  _mm256_store_ps(h, hi);
  for (int k = 0; k < 8; ++k) {
    *lo_out = l[k] < *lo_out ? l[k] : *lo_out;
    *hi_out = h[k] > *hi_out ? h[k] : *hi_out;
  }
  lanes_scalar(x, i, n, x0, f, lo_out, hi_out);
}

__attribute__((target("avx512f"))) inline void lanes_avx512(const float* x, int64_t n, float x0,
                                                            Lanes* f, float* lo_out,
                                                            float* hi_out) {
  const __m512 c = _mm512_set1_ps(x0);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, q0 = a0, q1 = a0;
  __m512 lo = _mm512_set1_ps(*lo_out), hi = _mm512_set1_ps(*hi_out);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
    lo = _mm512_min_ps(lo, _mm512_min_ps(v0, v1));
    hi = _mm512_max_ps(hi, _mm512_max_ps(v0, v1));
    const __m512 d0 = _mm512_sub_ps(v0, c), d1 = _mm512_sub_ps(v1, c);
    a0 = _mm512_add_ps(a0, d0);
    a1 = _mm512_add_ps(a1, d1);
    q0 = _mm512_add_ps(q0, _mm512_mul_ps(d0, d0));
    q1 = _mm512_add_ps(q1, _mm512_mul_ps(d1, d1));
  }
  _mm512_store_ps(f->f1, a0);
  _mm512_store_ps(f->f1 + 16, a1);
  _mm512_store_ps(f->f2, q0);
  _mm512_store_ps(f->f2 + 16, q1);
  *lo_out = _mm512_reduce_min_ps(lo);
  *hi_out = _mm512_reduce_max_ps(hi);
  lanes_scalar(x, i, n, x0, f, lo_out, hi_out);
}
#endif

// Fills m for x[0 .. n); false if the float sums overflowed (or x holds a NaN or Inf).
inline bool moments_fast(const float* x, int64_t n, Moments* m) {
  const float x0 = x[0];
  for (int l = 0; l < kLanes; ++l) m->s1[l] = m->s2[l] = 0.0;
#if PRIME_COMM_X86
  const Simd level = simd_level();
#endif
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t len = std::min(kChunk, n - c);
    Lanes f;
    std::memset(&f, 0, sizeof(f));
#if PRIME_COMM_X86
    if (level == Simd::kAvx512) {
      lanes_avx512(x + c, len, x0, &f, &m->lo, &m->hi);
    } else if (level == Simd::kAvx2) {
      lanes_avx2(x + c, len, x0, &f, &m->lo, &m->hi);
    } else {
      lanes_portable(x + c, len, x0, &f, &m->lo, &m->hi);
    }
#else
    lanes_portable(x + c, len, x0, &f, &m->lo, &m->hi);
#endif
    for (int l = 0; l < kLanes; ++l) {
      m->s1[l] += f.f1[l];
      m->s2[l] += f.f2[l];
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    if (!std::isfinite(m->s1[l]) || !std::isfinite(m->s2[l])) return false;
  }
  return true;
}

// The same moments in plain double (finite x whose float sums overflowed).
inline void moments_double(const float* x, int64_t n, Moments* m) {
  const double x0 = x[0];
  for (int l = 0; l < kLanes; ++l) m->s1[l] = m->s2[l] = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(x[i]) - x0;
    m->s1[0] += d;
    m->s2[0] += d * d;
  }
}

inline double lane_sum(double* s) {
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) s[l] = s[l] + s[l + w];
  }
  return s[0];
}

// ---- codes ---------------------------------------------------------------------------------
//
// th[0 .. L-2] are the decision thresholds (ascending), th[L-1] a copy of the last one; the
// code of x is the number of thresholds <= x, by binary search.

template <int Bits>
inline int code_of(float x, const float* th) {
  int c;
  if (Bits == 4) {
    c = x >= th[7] ? 8 : 0;
    c += x >= th[c + 3] ? 4 : 0;
    c += x >= th[c + 1] ? 2 : 0;
    c += x >= th[c] ? 1 : 0;
  } else {
    c = x >= th[1] ? 2 : 0;
    c += x >= th[c] ? 1 : 0;
  }
  return c;
}

// The final n % G elements, packed in order; codes holds ceil(n * Bits / 8) bytes.
template <int Bits>
inline void encode_tail(const float* x, int64_t n, const float* th, uint8_t* codes) {
  std::memset(codes, 0, static_cast<size_t>((n * Bits + 7) / 8));
  for (int64_t i = 0; i < n; ++i) {
    codes[i * Bits / 8] |= static_cast<uint8_t>(code_of<Bits>(x[i], th) << ((i * Bits) % 8));
  }
}

template <int Bits>
inline void encode_portable(const float* x, int64_t n, const float* th, uint8_t* codes) {
  constexpr int64_t G = kGroup<Bits>;
  const int64_t full = n / G;
  for (int64_t g = 0; g < full; ++g) {
    const float* xg = x + g * G;
    for (int j = 0; j < 16; ++j) {
      int byte = 0;
      for (int s = 0; s < 8 / Bits; ++s) byte |= code_of<Bits>(xg[j + 16 * s], th) << (Bits * s);
      codes[g * 16 + j] = static_cast<uint8_t>(byte);
    }
  }
  encode_tail<Bits>(x + full * G, n - full * G, th, codes + full * 16);
}

#if PRIME_COMM_X86
// One vector of codes (32-bit lanes) for 8 floats. a = {th[1], th[5], th[9], th[13]} and
// b = {th[0], th[2], ..., th[14]} serve the last two steps of the search by permutes.
template <int Bits>
__attribute__((target("avx2"))) inline __m256i code8_avx2(__m256 v, const __m256* t) {
  if (Bits == 4) {
    // t: th7, th3, th11, a, b
    __m256 m = _mm256_cmp_ps(v, t[0], _CMP_GE_OQ);
    __m256i c = _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(8));
    m = _mm256_cmp_ps(v, _mm256_blendv_ps(t[1], t[2], m), _CMP_GE_OQ);
    c = _mm256_or_si256(c, _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(4)));
    m = _mm256_cmp_ps(v, _mm256_permutevar8x32_ps(t[3], _mm256_srli_epi32(c, 2)), _CMP_GE_OQ);
    c = _mm256_or_si256(c, _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(2)));
    m = _mm256_cmp_ps(v, _mm256_permutevar8x32_ps(t[4], _mm256_srli_epi32(c, 1)), _CMP_GE_OQ);
    return _mm256_or_si256(c, _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(1)));
  } else {
    // t: th1, th0, th2
    const __m256 m = _mm256_cmp_ps(v, t[0], _CMP_GE_OQ);
    const __m256i c = _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(2));
    const __m256 m2 = _mm256_cmp_ps(v, _mm256_blendv_ps(t[1], t[2], m), _CMP_GE_OQ);
    return _mm256_or_si256(c, _mm256_and_si256(_mm256_castps_si256(m2), _mm256_set1_epi32(1)));
  }
}

template <int Bits>
__attribute__((target("avx2"))) inline void encode_avx2(const float* x, int64_t n,
                                                        const float* th, uint8_t* codes,
                                                        const float* next) {
  constexpr int64_t G = kGroup<Bits>;
  __m256 t[5];
  if (Bits == 4) {
    t[0] = _mm256_set1_ps(th[7]);
    t[1] = _mm256_set1_ps(th[3]);
    t[2] = _mm256_set1_ps(th[11]);
    t[3] = _mm256_setr_ps(th[1], th[5], th[9], th[13], th[13], th[13], th[13], th[13]);
    t[4] = _mm256_setr_ps(th[0], th[2], th[4], th[6], th[8], th[10], th[12], th[14]);
  } else {
    t[0] = _mm256_set1_ps(th[1]);
    t[1] = _mm256_set1_ps(th[0]);
    t[2] = _mm256_set1_ps(th[2]);
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t full = n / G;
  for (int64_t g = 0; g < full; ++g) {
    const float* xg = x + g * G;
    if (next != nullptr) {
      for (int k = 0; k < G * 4; k += 64) _mm_prefetch(reinterpret_cast<const char*>(next + g * G) + k, _MM_HINT_T1);
    }
    // w0: bytes 0..7 of the group, w1: bytes 8..15 (element j + 8 in the low bits).
    __m256i w0, w1;
    if (Bits == 4) {
      w0 = _mm256_or_si256(code8_avx2<4>(_mm256_loadu_ps(xg), t),
                           _mm256_slli_epi32(code8_avx2<4>(_mm256_loadu_ps(xg + 16), t), 4));
      w1 = _mm256_or_si256(code8_avx2<4>(_mm256_loadu_ps(xg + 8), t),
                           _mm256_slli_epi32(code8_avx2<4>(_mm256_loadu_ps(xg + 24), t), 4));
    } else {
      w0 = w1 = _mm256_setzero_si256();
      for (int s = 0; s < 4; ++s) {
        w0 = _mm256_or_si256(w0, _mm256_slli_epi32(code8_avx2<2>(_mm256_loadu_ps(xg + 16 * s), t), 2 * s));
        w1 = _mm256_or_si256(w1, _mm256_slli_epi32(code8_avx2<2>(_mm256_loadu_ps(xg + 16 * s + 8), t), 2 * s));
      }
    }
    // 32-bit lanes -> bytes: lane order (0..3 of w0, 0..3 of w1 | 4..7 of w0, 4..7 of w1).
    const __m256i words = _mm256_packus_epi32(w0, w1);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(words, words), order);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * 16), _mm256_castsi256_si128(bytes));
  }
  encode_tail<Bits>(x + full * G, n - full * G, th, codes + full * 16);
}

template <int Bits>
__attribute__((target("avx512f"))) inline __m512i code16_avx512(__m512 v, const __m512* t) {
  if (Bits == 4) {
    // t: th7, th[i + 3], th[i + 1], th[i] (16-entry tables indexed by the code so far)
    __mmask16 m = _mm512_cmp_ps_mask(v, t[0], _CMP_GE_OQ);
    __m512i c = _mm512_maskz_mov_epi32(m, _mm512_set1_epi32(8));
    m = _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(c, t[1]), _CMP_GE_OQ);
    c = _mm512_mask_or_epi32(c, m, c, _mm512_set1_epi32(4));
    m = _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(c, t[2]), _CMP_GE_OQ);
    c = _mm512_mask_or_epi32(c, m, c, _mm512_set1_epi32(2));
    m = _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(c, t[3]), _CMP_GE_OQ);
    return _mm512_mask_or_epi32(c, m, c, _mm512_set1_epi32(1));
  } else {
    // t: th1, th0, th2
    const __mmask16 m = _mm512_cmp_ps_mask(v, t[0], _CMP_GE_OQ);
    const __m512i c = _mm512_maskz_mov_epi32(m, _mm512_set1_epi32(2));
    const __mmask16 m2 = _mm512_cmp_ps_mask(v, _mm512_mask_blend_ps(m, t[1], t[2]), _CMP_GE_OQ);
    return _mm512_mask_or_epi32(c, m2, c, _mm512_set1_epi32(1));
  }
}

template <int Bits>
__attribute__((target("avx512f"))) inline void encode_avx512(const float* x, int64_t n,
                                                             const float* th, uint8_t* codes,
                                                             const float* next) {
  constexpr int64_t G = kGroup<Bits>;
  __m512 t[4];
  if (Bits == 4) {
    alignas(64) float t3[16], t1[16];
    for (int i = 0; i < 16; ++i) {
      t3[i] = th[std::min(i + 3, 15)];
      t1[i] = th[std::min(i + 1, 15)];
    }
    t[0] = _mm512_set1_ps(th[7]);
    t[1] = _mm512_load_ps(t3);
    t[2] = _mm512_load_ps(t1);
    t[3] = _mm512_loadu_ps(th);
  } else {
    t[0] = _mm512_set1_ps(th[1]);
    t[1] = _mm512_set1_ps(th[0]);
    t[2] = _mm512_set1_ps(th[2]);
  }
  const int64_t full = n / G;
  for (int64_t g = 0; g < full; ++g) {
    const float* xg = x + g * G;
    if (next != nullptr) {
      for (int k = 0; k < G * 4; k += 64) _mm_prefetch(reinterpret_cast<const char*>(next + g * G) + k, _MM_HINT_T1);
    }
    __m512i w = code16_avx512<Bits>(_mm512_loadu_ps(xg), t);
    for (int s = 1; s < 8 / Bits; ++s) {
      w = _mm512_or_si512(
          w, _mm512_slli_epi32(code16_avx512<Bits>(_mm512_loadu_ps(xg + 16 * s), t), Bits * s));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * 16), _mm512_cvtepi32_epi8(w));
  }
  encode_tail<Bits>(x + full * G, n - full * G, th, codes + full * 16);
}
#endif

// ---- one block -----------------------------------------------------------------------------

// Quantizes one block of 0 < n <= kBlock floats into codebook[L] and the packed codes;
// returns false if it holds a NaN or Inf. more_after: another block follows x + kBlock.
template <int Bits>
inline bool quantize_block(const float* x, int64_t n, float* codebook, uint8_t* codes,
                           bool more_after = false) {
  constexpr int L = kL<Bits>;
  Moments m;
  if (!moments_fast(x, n, &m)) {
    float lo, hi;
    if (!minmax(x, n, &lo, &hi)) return false;  // a NaN or Inf
    m.lo = lo;
    m.hi = hi;
    moments_double(x, n, &m);
  }
  const double s1 = lane_sum(m.s1), s2 = lane_sum(m.s2), x0 = x[0];
  const float lo = m.lo == 0.0f ? 0.0f : m.lo, hi = m.hi == 0.0f ? 0.0f : m.hi;
  const double dn = static_cast<double>(n);
  const double mean = s1 / dn;
  const double var = s2 / dn - mean * mean;
  const double mu = x0 + mean, sigma = var > 0 ? std::sqrt(var) : 0.0;
  alignas(64) float th[16];
  for (int j = 0; j < L; ++j) {
    double v = mu + sigma * normal_level<Bits>(j);
    v = v < lo ? lo : (v > hi ? hi : v);
    codebook[j] = static_cast<float>(v);
  }
  for (int j = 0; j + 1 < L; ++j) {
    th[j] = static_cast<float>(0.5 * (static_cast<double>(codebook[j]) + codebook[j + 1]));
  }
  for (int j = L - 1; j < 16; ++j) th[j] = th[L - 2];
  const float* next = more_after ? x + kBlock : nullptr;
#if PRIME_COMM_X86
  const Simd level = simd_level();
  if (level == Simd::kAvx512) {
    encode_avx512<Bits>(x, n, th, codes, next);
  } else if (level == Simd::kAvx2) {
    encode_avx2<Bits>(x, n, th, codes, next);
  } else {
    encode_portable<Bits>(x, n, th, codes);
  }
#else
  (void)next;
  encode_portable<Bits>(x, n, th, codes);
#endif
  return true;
}

// ---- decoding ------------------------------------------------------------------------------

template <int Bits, int Mode>  // 0: out = cb[c], 1: out += cb[c]
inline void put(float* o, float v) {
  if (Mode == 0) {
    *o = v;
  } else {
    *o = *o + v;
  }
}

template <int Bits, int Mode>
inline void decode_tail(const float* cb, const uint8_t* codes, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const int c = (codes[i * Bits / 8] >> ((i * Bits) % 8)) & (kL<Bits> - 1);
    put<Bits, Mode>(out + i, cb[c]);
  }
}

template <int Bits, int Mode>
inline void decode_portable(const float* __restrict cb, const uint8_t* __restrict codes,
                            int64_t n, float* __restrict out) {
  constexpr int64_t G = kGroup<Bits>;
  const int64_t full = n / G;
  for (int64_t g = 0; g < full; ++g) {
    for (int s = 0; s < 8 / Bits; ++s) {
      float* o = out + g * G + 16 * s;
      for (int j = 0; j < 16; ++j) {
        put<Bits, Mode>(o + j, cb[(codes[g * 16 + j] >> (Bits * s)) & (kL<Bits> - 1)]);
      }
    }
  }
  decode_tail<Bits, Mode>(cb, codes + full * 16, n - full * G, out + full * G);
}

#if PRIME_COMM_X86
// stream: write the full groups with non-temporal stores (Mode 0, out 32-byte aligned).
template <int Mode>
__attribute__((target("avx2"))) inline void put8(float* o, __m256 v, bool stream) {
  if (Mode == 1) {
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), v));
  } else if (stream) {
    _mm256_stream_ps(o, v);
  } else {
    _mm256_storeu_ps(o, v);
  }
}

template <int Bits, int Mode>
__attribute__((target("avx2"))) inline void decode_avx2(const float* cb, const uint8_t* codes,
                                                        int64_t n, float* out, bool stream) {
  constexpr int64_t G = kGroup<Bits>;
  const int64_t full = n / G;
  // The permutes use the low 3 bits of an index. 4 bits: two 8-entry halves, chosen by bit 3
  // (moved to the sign bit for blendv). 2 bits: the 4 entries twice, so bit 2 is ignored.
  const __m256 lo8 = _mm256_loadu_ps(cb);
  const __m256 hi8 = Bits == 4 ? _mm256_loadu_ps(cb + 8) : lo8;
  const __m256 cb8 = Bits == 2 ? _mm256_setr_ps(cb[0], cb[1], cb[2], cb[3], cb[0], cb[1], cb[2],
                                                cb[3])
                               : lo8;
  for (int64_t g = 0; g < full; ++g) {
    float* o = out + g * G;
    for (int h = 0; h < 2; ++h) {  // bytes 8h .. 8h + 7 of the group
      const __m256i v = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + g * 16 + 8 * h)));
      if (Bits == 4) {
        const __m256i hi = _mm256_srli_epi32(v, 4);
        put8<Mode>(o + 8 * h, _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo8, v),
                                               _mm256_permutevar8x32_ps(hi8, v),
                                               _mm256_castsi256_ps(_mm256_slli_epi32(v, 28))),
                   stream);
        put8<Mode>(o + 16 + 8 * h, _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo8, hi),
                                                    _mm256_permutevar8x32_ps(hi8, hi),
                                                    _mm256_castsi256_ps(_mm256_slli_epi32(v, 24))),
                   stream);
      } else {
        for (int s = 0; s < 4; ++s) {
          put8<Mode>(o + 16 * s + 8 * h,
                     _mm256_permutevar8x32_ps(cb8, _mm256_srli_epi32(v, 2 * s)), stream);
        }
      }
    }
  }
  decode_tail<Bits, Mode>(cb, codes + full * 16, n - full * G, out + full * G);
}

template <int Mode>
__attribute__((target("avx512f"))) inline void put16(float* o, __m512 v, bool stream) {
  if (Mode == 1) {
    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), v));
  } else if (stream) {
    _mm512_stream_ps(o, v);
  } else {
    _mm512_storeu_ps(o, v);
  }
}

template <int Bits, int Mode>
__attribute__((target("avx512f"))) inline void decode_avx512(const float* cb,
                                                             const uint8_t* codes, int64_t n,
                                                             float* out, bool stream) {
  constexpr int64_t G = kGroup<Bits>;
  const int64_t full = n / G;
  // vpermps uses the low 4 bits of an index: at 2 bits the 4 entries repeat four times, so
  // the bits of the next code above an index are ignored and no mask is needed.
  alignas(64) float table[16];
  for (int i = 0; i < 16; ++i) table[i] = cb[i & (kL<Bits> - 1)];
  const __m512 t = _mm512_load_ps(table);
  for (int64_t g = 0; g < full; ++g) {
    const __m512i v =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * 16)));
    float* o = out + g * G;
    put16<Mode>(o, _mm512_permutexvar_ps(v, t), stream);
    for (int s = 1; s < 8 / Bits; ++s) {
      put16<Mode>(o + 16 * s, _mm512_permutexvar_ps(_mm512_srli_epi32(v, Bits * s), t), stream);
    }
  }
  decode_tail<Bits, Mode>(cb, codes + full * 16, n - full * G, out + full * G);
}
#endif

// Decodes one block of n <= kBlock elements. stream (Mode 0 only): write around the cache
// where the output is aligned for it; call store_fence() before the output is handed on.
template <int Bits, int Mode>
inline void decode_block(const float* cb, const uint8_t* codes, int64_t n, float* out,
                         bool stream = false) {
#if PRIME_COMM_X86
  const Simd level = simd_level();
  const bool aligned = reinterpret_cast<std::uintptr_t>(out) % 64 == 0;
  if (level == Simd::kAvx512) {
    decode_avx512<Bits, Mode>(cb, codes, n, out, Mode == 0 && stream && aligned);
    return;
  }
  if (level == Simd::kAvx2) {
    decode_avx2<Bits, Mode>(cb, codes, n, out, Mode == 0 && stream && aligned);
    return;
  }
#endif
  (void)stream;
  decode_portable<Bits, Mode>(cb, codes, n, out);
}

}  // namespace lowbit
}  // namespace prime_comm
