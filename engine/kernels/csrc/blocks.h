// GGUF blocks as the kernels read them (engine/kernels/csrc/quant_linear.cpp): one block's 32
// quants unpacked to float32 vectors, the packed matrix, prefetching, and dequantizing whole rows.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace jitney_kernels {

constexpr int64_t kBlock = 32;

// One block's 32 quants as four vectors of 8 floats: elements 0-7, 8-15, 16-23, 24-31.
struct Q4_1 {
  static constexpr bool kHasMin = true;
  static constexpr int64_t kBlockBytes = 16;
  static inline void unpack(const uint8_t* p, __m256 q[4]) {
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    // Bytes 0-7 zero-extended to int32: low nibbles are elements 0-7, high nibbles 16-23.
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low4));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
};

struct Q8_0 {
  static constexpr bool kHasMin = false;
  static constexpr int64_t kBlockBytes = 32;
  static inline void unpack(const uint8_t* p, __m256 q[4]) {
    for (int i = 0; i < 4; ++i) {
      const auto* src = reinterpret_cast<const __m128i*>(p + 8 * i);
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(src)));
    }
  }
};

struct Packed {
  const uint8_t* qs;
  const float* d;
  const float* m;  // nullptr for Q8_0
  int64_t N, K, NB;
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The rows are contiguous and read in order, but the hardware prefetcher alone leaves the kernel
// waiting on memory (measured: 2-3x slower on matrices that do not fit in cache, ~1x on ones that
// do). So each block asks for the same block kPrefetchRows rows further on (4-6 KiB ahead); past
// the end of the arrays the hint is dropped, it never faults.
constexpr int64_t kPrefetchRows = 8;

template <class Fmt>
inline void prefetch_ahead(const Packed& w, int64_t n, int64_t b) {
  const int64_t ahead = n + kPrefetchRows;
  _mm_prefetch(reinterpret_cast<const char*>(w.qs + (ahead * w.NB + b) * Fmt::kBlockBytes),
               _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w.d + ahead * w.NB + b), _MM_HINT_T0);
  if constexpr (Fmt::kHasMin) {
    _mm_prefetch(reinterpret_cast<const char*>(w.m + ahead * w.NB + b), _MM_HINT_T0);
  }
}

// Rows n0..n0+rows of w as float32 [rows, K] (d*q + m, bit-exact with gguf's dequantize: d*q is
// exact in float32, so the fused multiply-add rounds once, like the separate add).
template <class Fmt>
void dequantize_rows(const Packed& w, int64_t n0, int64_t rows, float* out) {
  const int64_t row_bytes = w.NB * Fmt::kBlockBytes;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    for (int64_t b = 0; b < w.NB; ++b) {
      __m256 q[4];
      prefetch_ahead<Fmt>(w, n, b);
      Fmt::unpack(w.qs + n * row_bytes + b * Fmt::kBlockBytes, q);
      const __m256 dv = _mm256_broadcast_ss(w.d + n * w.NB + b);
      float* o = out + r * w.K + b * kBlock;
      for (int i = 0; i < 4; ++i) {
        __m256 v;
        if constexpr (Fmt::kHasMin) {
          v = _mm256_fmadd_ps(q[i], dv, _mm256_broadcast_ss(w.m + n * w.NB + b));
        } else {
          v = _mm256_mul_ps(q[i], dv);
        }
        _mm256_storeu_ps(o + 8 * i, v);
      }
    }
  }
}

}  // namespace jitney_kernels
