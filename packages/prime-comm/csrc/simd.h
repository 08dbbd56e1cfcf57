// Run-time choice of the SIMD level. The wheel is built for plain x86-64 (no -march);
// the AVX2 and AVX-512 paths are compiled per function (target attributes) and picked here
// from what the CPU (and the OS, for AVX-512 state) supports. Every level writes the same
// bytes, so the choice changes speed only.
#pragma once

// GCC 12 flags its own AVX-512 intrinsics (their "undefined" operands) as uninitialized
// under -Wextra: a false positive that would bury real warnings.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

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

namespace prime_comm {

enum class Simd : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// AVX-512 here means F + BW + VBMI (byte permutes): Ice Lake and later, Zen 4 and later.
inline Simd cpu_simd() {
#if PRIME_COMM_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vbmi")) {
    return Simd::kAvx512;
  }
  if (__builtin_cpu_supports("avx2")) return Simd::kAvx2;
#endif
  return Simd::kScalar;
}

// The level in use: the CPU's best unless a test lowered it (set_simd).
inline Simd& simd_level() {
  static Simd level = cpu_simd();
  return level;
}

inline const char* simd_name(Simd s) {
  return s == Simd::kAvx512 ? "avx512" : (s == Simd::kAvx2 ? "avx2" : "scalar");
}

}  // namespace prime_comm
