// Blockwise uint8 quantization with a 256-entry float32 codebook per block: the encoder.
//
// Encoding of n floats: [nb codebooks of 256 float32][n uint8 codes], nb = ceil(n / kBlock).
// Per block: codes split [min, max] into 256 equal bins; each codebook entry is the mean of
// the inputs that fell into its bin (to 1/65536 of a bin width, exact integer sums), so a
// constant block decodes exactly and the error is at most one bin width. Every block is
// processed by one thread from start to end, and every arithmetic step is plain IEEE
// float/double with no contraction, so the bytes are identical for any thread count and
// every SIMD level.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace prime_comm {

constexpr int64_t kBlock = 65536;
constexpr int kLevels = 256;
constexpr int64_t kCodebookBytes = kLevels * sizeof(float);

inline int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }
inline int64_t encoded_bytes(int64_t n) { return num_blocks(n) * kCodebookBytes + n; }

// The general layout (lowbit.h): 2^bits float32 entries per block, then bits per element.
inline int64_t codebook_bytes(int bits) { return int64_t(4) << bits; }
inline int64_t encoded_bytes(int64_t n, int bits) {
  return num_blocks(n) * codebook_bytes(bits) + (n * bits + 7) / 8;
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

__attribute__((target("avx512f"))) inline bool minmax_avx512(const float* x, int64_t n,
                                                             float* lo_out, float* hi_out) {
  const __m512 big = _mm512_set1_ps(FLT_MAX);
  __m512 lo0 = big, lo1 = big, hi0 = _mm512_set1_ps(-FLT_MAX), hi1 = hi0;
  __mmask16 ok = 0xffff;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    ok &= _mm512_cmp_ps_mask(_mm512_abs_ps(a), big, _CMP_LE_OQ);
    ok &= _mm512_cmp_ps_mask(_mm512_abs_ps(b), big, _CMP_LE_OQ);
    lo0 = _mm512_min_ps(lo0, a);
    lo1 = _mm512_min_ps(lo1, b);
    hi0 = _mm512_max_ps(hi0, a);
    hi1 = _mm512_max_ps(hi1, b);
  }
  alignas(64) float l[16], h[16];
  _mm512_store_ps(l, _mm512_min_ps(lo0, lo1));
  _mm512_store_ps(h, _mm512_max_ps(hi0, hi1));
  float lo, hi;
  bool finite = minmax_scalar(x + i, n - i, &lo, &hi) && ok == 0xffff;
  for (int k = 0; k < 16; ++k) {
    lo = l[k] < lo ? l[k] : lo;
    hi = h[k] > hi ? h[k] : hi;
  }
  *lo_out = lo;
  *hi_out = hi;
  return finite;
}
#endif

// Min and max of finite x (false if a NaN or Inf is present). A zero bound is +0 whatever
// the sign of the zeros seen: which zero a min instruction keeps depends on the order of
// the comparisons, and the bytes must not depend on the SIMD level.
inline bool minmax(const float* x, int64_t n, float* lo, float* hi) {
  bool finite;
#if PRIME_COMM_X86
  const Simd level = simd_level();
  if (level == Simd::kAvx512) {
    finite = minmax_avx512(x, n, lo, hi);
  } else if (level == Simd::kAvx2) {
    finite = minmax_avx2(x, n, lo, hi);
  } else {
    finite = minmax_scalar(x, n, lo, hi);
  }
#else
  finite = minmax_scalar(x, n, lo, hi);
#endif
  *lo = *lo == 0.0f ? 0.0f : *lo;
  *hi = *hi == 0.0f ? 0.0f : *hi;
  return finite;
}

// ---- codes and per-bin statistics ---------------------------------------------------------
//
// Each element becomes one 64-bit word: code << 56 | 1 << 40 | frac, where frac is its
// position inside the bin in 1/65536 steps. Adding the word to its bin's accumulator counts
// the element (bits 40..55) and sums its position (bits 0..39), exact and order independent;
// bits 56 and up collect garbage and are masked off at the end. Four tables, element j of a
// run going to table j % 4, break store-load chains and keep each table's count below 2^15
// and its position sum below 2^31, so the fields never spill into each other.
// A bin's mean is then lo + (code + mean position) * width, accurate to 1/65536 of a bin.

constexpr uint64_t kCountOne = uint64_t(1) << 40;
constexpr int kCodeShift = 56;
constexpr uint64_t kStatsMask = (uint64_t(1) << kCodeShift) - 1;
constexpr float kFracSteps = 65536.0f;
constexpr int64_t kTile = 1024;          // words buffered between the vector and table passes
using BinTables = uint64_t[4][kLevels];

// One element: (x - lo) * (scale * 65536) is exactly 65536 * t (t = (x - lo) * scale, the
// position in bins), so its integer part holds the code (bits 16 and up, clamped to 255) and
// the position inside the bin (the bits below).
inline uint64_t pack_one(float x, float lo, float scale16, uint8_t* code) {
  const int32_t big = static_cast<int32_t>((x - lo) * scale16);  // >= 0: lo is the minimum
  const int32_t c = std::min(big >> 16, 255);
  const int32_t f = std::min(big - (c << 16), 65536);
  *code = static_cast<uint8_t>(c);
  return (static_cast<uint64_t>(c) << kCodeShift) | kCountOne | static_cast<uint32_t>(f);
}

inline void add_to_tables(const uint64_t* w, int64_t n, BinTables acc) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    acc[0][w[j] >> kCodeShift] += w[j];
    acc[1][w[j + 1] >> kCodeShift] += w[j + 1];
    acc[2][w[j + 2] >> kCodeShift] += w[j + 2];
    acc[3][w[j + 3] >> kCodeShift] += w[j + 3];
  }
  for (; j < n; ++j) acc[j & 3][w[j] >> kCodeShift] += w[j];
}

// The portable path (and the SIMD paths' tails).
inline void encode_portable(const float* x, int64_t n, float lo, float scale, uint8_t* codes,
                            BinTables acc) {
  const float scale16 = scale * kFracSteps;
  uint64_t w[kTile];
  for (int64_t i = 0; i < n; i += kTile) {
    const int64_t len = std::min(kTile, n - i);
    for (int64_t j = 0; j < len; ++j) w[j] = pack_one(x[i + j], lo, scale16, codes + i + j);
    add_to_tables(w, len, acc);
  }
}

#if PRIME_COMM_X86
// The AVX2 path computes the words of tile t + 1 in the same loop that adds tile t's words
// to the tables, so the vector units and the scalar table updates run side by side (reading
// words right after their vector store would stall on store-to-load forwarding). The words
// of a vector are stored in a lane order that differs from the elements' (unpack), which the
// order-independent sums do not see. prefetch: also pull the next block towards L2.

// Codes of 32 elements into codes[0..31], their words into w[0..31].
__attribute__((target("avx2"))) inline void encode32_avx2(const float* x, __m256 vlo,
                                                          __m256 vs16, uint8_t* codes,
                                                          uint64_t* w) {
  const __m256i top = _mm256_set1_epi32(255), ftop = _mm256_set1_epi32(65536);
  const __m256i count = _mm256_set1_epi32(1 << (40 - 32));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i c[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 v = _mm256_loadu_ps(x + 8 * k);
    const __m256i big = _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_sub_ps(v, vlo), vs16));
    c[k] = _mm256_min_epi32(_mm256_srli_epi32(big, 16), top);
    const __m256i f = _mm256_min_epi32(_mm256_sub_epi32(big, _mm256_slli_epi32(c[k], 16)), ftop);
    const __m256i high = _mm256_or_si256(_mm256_slli_epi32(c[k], kCodeShift - 32), count);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + 8 * k), _mm256_unpacklo_epi32(f, high));
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + 8 * k + 4), _mm256_unpackhi_epi32(f, high));
  }
  const __m256i ab = _mm256_packus_epi32(c[0], c[1]);
  const __m256i cd = _mm256_packus_epi32(c[2], c[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), bytes);
}

__attribute__((target("avx2"))) inline void encode_avx2(const float* x, int64_t n, float lo,
                                                        float scale, uint8_t* codes,
                                                        BinTables acc, bool prefetch) {
  const __m256 vlo = _mm256_set1_ps(lo);
  const __m256 vs16 = _mm256_set1_ps(scale * kFracSteps);
  alignas(64) uint64_t ws[2][kTile];
  const int64_t m = n & ~int64_t(31);
  const int64_t tiles = (m + kTile - 1) / kTile;
  auto tile_len = [&](int64_t t) { return std::min(kTile, m - t * kTile); };
  for (int64_t t = -1; t < tiles; ++t) {
    const int64_t lc = t >= 0 ? tile_len(t) : 0, ln = t + 1 < tiles ? tile_len(t + 1) : 0;
    const uint64_t* cur = ws[(t + 2) & 1];
    uint64_t* next = ws[(t + 1) & 1];
    const int64_t base = (t + 1) * kTile;
    int64_t j = 0;
    for (; j < ln; j += 32) {
      if (prefetch) {
        const char* p = reinterpret_cast<const char*>(x + kBlock + base + j);
        _mm_prefetch(p, _MM_HINT_T1);
        _mm_prefetch(p + 64, _MM_HINT_T1);
      }
      encode32_avx2(x + base + j, vlo, vs16, codes + base + j, next + j);
      if (j < lc) add_to_tables(cur + j, 32, acc);
    }
    if (j < lc) add_to_tables(cur + j, lc - j, acc);
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
  alignas(64) uint64_t acc[4][kLevels];
  std::memset(acc, 0, sizeof(acc));
  if (range <= FLT_MAX && std::isfinite(scale * kFracSteps)) {
#if PRIME_COMM_X86
    // AVX-512 runs the AVX2 encoder: the scalar table updates bound it, and the wider
    // vectors measured no faster (Zen 4 splits them in two).
    if (simd_level() != Simd::kScalar) {
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
      acc[i & 3][c] += kCountOne + (f >= 65536.0 ? 65536u : static_cast<uint32_t>(f));
    }
  }
  const double width = range / kLevels;
  for (int c = 0; c < kLevels; ++c) {
    uint64_t a = 0;
    for (int k = 0; k < 4; ++k) a += acc[k][c] & kStatsMask;
    const uint64_t m = a >> 40;
    // An unused bin gets its centre, so the codebook is always well defined.
    const double pos = m > 0 ? static_cast<double>(a & (kCountOne - 1)) / (kFracSteps * m) : 0.5;
    double v = range > 0 ? lo + (c + pos) * width : lo;
    v = v < lo ? lo : (v > hi ? hi : v);
    codebook[c] = static_cast<float>(v);
  }
  return true;
}

}  // namespace prime_comm
