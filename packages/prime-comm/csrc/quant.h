// Blockwise uint8 quantization with a 256-entry float32 codebook per block.
//
// Encoding of n floats: [nb codebooks of 256 float32][n uint8 codes], nb = ceil(n / kBlock).
// Per block: codes split [min, max] into 256 equal bins; each codebook entry is the mean of
// the inputs that fell into its bin (to 1/65536 of a bin width, exact integer sums), so a
// constant block decodes exactly and the error is at most one bin width. Every block is processed by
// one thread from start to end, and every arithmetic step is plain IEEE float/double with no
// contraction, so the bytes are identical for any thread count and either SIMD path.
#pragma once

// PRIME_COMM_X86=0 (e.g. -DPRIME_COMM_X86=0) builds the portable code only, as on ARM.
#ifndef PRIME_COMM_X86
#if defined(__x86_64__) || defined(__i386__)
#define PRIME_COMM_X86 1
#else
#define PRIME_COMM_X86 0
#endif
#endif
#if PRIME_COMM_X86
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace prime_comm {

constexpr int64_t kBlock = 65536;
constexpr int kLevels = 256;
constexpr int64_t kCodebookBytes = kLevels * sizeof(float);

inline int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }
inline int64_t encoded_bytes(int64_t n) { return num_blocks(n) * kCodebookBytes + n; }

inline bool cpu_has_avx2() {
#if PRIME_COMM_X86
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

inline bool& use_avx2() {
  static bool on = cpu_has_avx2();
  return on;
}

// ---- min / max / finite ------------------------------------------------------------------

inline bool minmax_scalar(const float* x, int64_t n, float* lo_out, float* hi_out) {
  float lo = FLT_MAX, hi = -FLT_MAX;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    finite &= std::fabs(v) <= FLT_MAX;  // false for NaN and +-Inf
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  *lo_out = lo;
  *hi_out = hi;
  return finite;
}

#if PRIME_COMM_X86
__attribute__((target("avx2"))) inline bool minmax_avx2(const float* x, int64_t n, float* lo_out,
                                                        float* hi_out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 big = _mm256_set1_ps(FLT_MAX);
  __m256 lo0 = _mm256_set1_ps(FLT_MAX), lo1 = lo0, hi0 = _mm256_set1_ps(-FLT_MAX), hi1 = hi0;
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(a, abs_mask), big, _CMP_LE_OQ));
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(b, abs_mask), big, _CMP_LE_OQ));
    lo0 = _mm256_min_ps(lo0, a);
    lo1 = _mm256_min_ps(lo1, b);
    hi0 = _mm256_max_ps(hi0, a);
    hi1 = _mm256_max_ps(hi1, b);
  }
  alignas(32) float l[8], h[8];
  _mm256_store_ps(l, _mm256_min_ps(lo0, lo1));
  _mm256_store_ps(h, _mm256_max_ps(hi0, hi1));
  float lo, hi;
  bool finite = minmax_scalar(x + i, n - i, &lo, &hi) && _mm256_movemask_ps(ok) == 0xff;
  for (int k = 0; k < 8; ++k) {
    lo = l[k] < lo ? l[k] : lo;
    hi = h[k] > hi ? h[k] : hi;
  }
  *lo_out = lo;
  *hi_out = hi;
  return finite;
}

#endif

inline bool minmax(const float* x, int64_t n, float* lo, float* hi) {
#if PRIME_COMM_X86
  if (use_avx2()) return minmax_avx2(x, n, lo, hi);
#endif
  return minmax_scalar(x, n, lo, hi);
}

// ---- codes and per-bin statistics ---------------------------------------------------------
//
// Each element adds (1 << 40) + frac to its bin's 64-bit accumulator, where frac is its
// position inside the bin in 1/65536 steps: one integer add gives the count (high bits) and
// the sum of positions (low 40 bits; at most 65536 * 65536), exact and order independent.
// A bin's mean is then lo + (code + mean position) * width, accurate to 1/65536 of a bin.

constexpr uint64_t kCountOne = uint64_t(1) << 40;
constexpr float kFracSteps = 65536.0f;
using BinTables = uint64_t[4][kLevels];  // four interleaved tables break store-load chains

// One element: (x - lo) * (scale * 65536) is exactly 65536 * t (t = (x - lo) * scale, the
// position in bins), so its integer part holds the code (bits 16 and up, clamped to 255) and
// the position inside the bin (the bits below). Packed as code | position << 8.
inline uint32_t pack_one(float x, float lo, float scale16) {
  const int32_t big = static_cast<int32_t>((x - lo) * scale16);  // >= 0: lo is the minimum
  const int32_t c = std::min(big >> 16, 255);
  const int32_t f = std::min(big - (c << 16), 65536);
  return static_cast<uint32_t>(c | (f << 8));
}

// The portable path (and the AVX2 path's tail): plain loops the compiler can vectorise.
inline void encode_portable(const float* x, int64_t n, float lo, float scale, uint8_t* codes,
                            BinTables acc) {
  const float scale16 = scale * kFracSteps;
  constexpr int64_t kTile = 1024;
  uint32_t w[kTile];
  for (int64_t i = 0; i < n; i += kTile) {
    const int64_t len = std::min(kTile, n - i);
    for (int64_t j = 0; j < len; ++j) {
      w[j] = pack_one(x[i + j], lo, scale16);
      codes[i + j] = static_cast<uint8_t>(w[j] & 255);
    }
    for (int64_t j = 0; j < len; ++j) acc[j & 3][w[j] & 255] += kCountOne + (w[j] >> 8);
  }
}

#if PRIME_COMM_X86
// Adds 32 packed (code | position << 8) words to the four tables.
inline void add_to_tables(const uint32_t* w, BinTables acc) {
  for (int j = 0; j < 32; j += 4) {
    acc[0][w[j] & 255] += kCountOne + (w[j] >> 8);
    acc[1][w[j + 1] & 255] += kCountOne + (w[j + 1] >> 8);
    acc[2][w[j + 2] & 255] += kCountOne + (w[j + 2] >> 8);
    acc[3][w[j + 3] & 255] += kCountOne + (w[j + 3] >> 8);
  }
}

// Codes of 32 elements into codes[0..31], packed words into w[0..31].
__attribute__((target("avx2"))) inline void encode32_avx2(const float* x, __m256 vlo,
                                                          __m256 vs16, uint8_t* codes,
                                                          uint32_t* w) {
  const __m256i top = _mm256_set1_epi32(255), ftop = _mm256_set1_epi32(65536);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i c[4];
  for (int k = 0; k < 4; ++k) {
    // (x - lo) * (scale * 65536) is exactly 65536 * t, so its integer part carries the code
    // (t's integer part) in bits 16 and up and the position in the bin below.
    const __m256 v = _mm256_loadu_ps(x + 8 * k);
    const __m256i big = _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_sub_ps(v, vlo), vs16));
    c[k] = _mm256_min_epi32(_mm256_srli_epi32(big, 16), top);
    const __m256i f = _mm256_min_epi32(_mm256_sub_epi32(big, _mm256_slli_epi32(c[k], 16)), ftop);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + 8 * k),
                       _mm256_or_si256(c[k], _mm256_slli_epi32(f, 8)));
  }
  const __m256i ab = _mm256_packus_epi32(c[0], c[1]);
  const __m256i cd = _mm256_packus_epi32(c[2], c[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), bytes);
}

// Vector codes for tile t + 1 are computed in the same loop that adds tile t's words to the
// tables, so the vector units and the scalar table updates run side by side; reading words
// right after their vector store would stall on store-to-load forwarding, a tile later not.
// prefetch_next: also pull the following block towards L2 while this one is encoded.
__attribute__((target("avx2"))) inline void encode_avx2(const float* x, int64_t n, float lo,
                                                        float scale, uint8_t* codes,
                                                        BinTables acc, bool prefetch_next) {
  const __m256 vlo = _mm256_set1_ps(lo);
  const __m256 vs16 = _mm256_set1_ps(scale * kFracSteps);
  constexpr int64_t kTile = 1024;
  alignas(32) uint32_t ws[2][kTile];
  const int64_t m = n & ~int64_t(31);  // the vector part; the rest: encode_portable
  const int64_t tiles = (m + kTile - 1) / kTile;
  auto tile_len = [&](int64_t t) { return std::min(kTile, m - t * kTile); };
  auto vec = [&](int64_t pos, uint32_t* w) {
    if (prefetch_next) {
      _mm_prefetch(reinterpret_cast<const char*>(x + kBlock + pos), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(x + kBlock + pos) + 64, _MM_HINT_T1);
    }
    encode32_avx2(x + pos, vlo, vs16, codes + pos, w);
  };
  if (tiles > 0) {
    for (int64_t j = 0; j < tile_len(0); j += 32) vec(j, ws[0] + j);
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const uint32_t* cur = ws[t & 1];
    uint32_t* next = ws[(t + 1) & 1];
    const int64_t lc = tile_len(t), ln = t + 1 < tiles ? tile_len(t + 1) : 0;  // ln <= lc
    int64_t j = 0;
    for (; j < ln; j += 32) {
      vec((t + 1) * kTile + j, next + j);
      add_to_tables(cur + j, acc);
    }
    for (; j < lc; j += 32) add_to_tables(cur + j, acc);
  }
  encode_portable(x + m, n - m, lo, scale, codes + m, acc);
}
#endif

// ---- one block ---------------------------------------------------------------------------

// Quantizes one block of n <= kBlock floats; returns false if it holds a NaN or Inf.
// more_after: another block follows x + kBlock in memory (worth prefetching).
inline bool quantize_block(const float* x, int64_t n, float* codebook, uint8_t* codes,
                           bool more_after = false) {
  float lo, hi;
  if (!minmax(x, n, &lo, &hi)) return false;
  const double range = static_cast<double>(hi) - static_cast<double>(lo);
  const double scale_d = range > 0 ? kLevels / range : 0.0;
  const float scale = static_cast<float>(scale_d);
  uint64_t acc[4][kLevels];
  std::memset(acc, 0, sizeof(acc));
  if (range <= FLT_MAX && std::isfinite(scale * kFracSteps)) {
#if PRIME_COMM_X86
    if (use_avx2()) {
      encode_avx2(x, n, lo, scale, codes, acc, more_after);
    } else {
      encode_portable(x, n, lo, scale, codes, acc);
    }
#else
    (void)more_after;
    encode_portable(x, n, lo, scale, codes, acc);
#endif
  } else {
    // Range beyond float (|x| near FLT_MAX) or a bin narrower than float can express.
    for (int64_t i = 0; i < n; ++i) {
      const double t = (static_cast<double>(x[i]) - lo) * scale_d;
      const int c = t >= 255.0 ? 255 : static_cast<int>(t);
      const double f = (t - c) * kFracSteps;
      codes[i] = static_cast<uint8_t>(c);
      acc[0][c] += kCountOne + (f >= 65536.0 ? 65536u : static_cast<uint32_t>(f));
    }
  }
  const double width = range / kLevels;
  for (int c = 0; c < kLevels; ++c) {
    const uint64_t a = acc[0][c] + acc[1][c] + acc[2][c] + acc[3][c];
    const uint64_t m = a >> 40;
    // An unused bin gets its centre, so the codebook is always well defined.
    const double pos = m > 0 ? static_cast<double>(a & (kCountOne - 1)) / (kFracSteps * m) : 0.5;
    double v = range > 0 ? lo + (c + pos) * width : lo;
    v = v < lo ? lo : (v > hi ? hi : v);
    codebook[c] = static_cast<float>(v);
  }
  return true;
}

// ---- decoding ----------------------------------------------------------------------------

template <int Mode>  // 0: out = cb[c], 1: out += cb[c]
__attribute__((always_inline)) inline void decode_body(const float* cb, const uint8_t* codes,
                                                       int64_t n, float* out) {
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
template <int Mode>
__attribute__((target("avx2"))) void decode_avx2(const float* cb, const uint8_t* codes, int64_t n,
                                                 float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i c16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    const __m256i ia = _mm256_cvtepu8_epi32(c16);
    const __m256i ib = _mm256_cvtepu8_epi32(_mm_srli_si128(c16, 8));
    __m256 va = _mm256_i32gather_ps(cb, ia, 4);
    __m256 vb = _mm256_i32gather_ps(cb, ib, 4);
    if (Mode == 1) {
      va = _mm256_add_ps(_mm256_loadu_ps(out + i), va);
      vb = _mm256_add_ps(_mm256_loadu_ps(out + i + 8), vb);
    }
    _mm256_storeu_ps(out + i, va);
    _mm256_storeu_ps(out + i + 8, vb);
  }
  decode_body<Mode>(cb, codes + i, n - i, out + i);
}

#endif

template <int Mode>
void decode_scalar(const float* cb, const uint8_t* codes, int64_t n, float* out) {
  decode_body<Mode>(cb, codes, n, out);
}

template <int Mode>
inline void decode_block(const float* cb, const uint8_t* codes, int64_t n, float* out) {
#if PRIME_COMM_X86
  if (use_avx2()) {
    decode_avx2<Mode>(cb, codes, n, out);
    return;
  }
#endif
  decode_scalar<Mode>(cb, codes, n, out);
}

inline void divide_block(float* out, int64_t n, float divisor) {
  for (int64_t i = 0; i < n; ++i) out[i] = out[i] / divisor;
}

}  // namespace prime_comm
