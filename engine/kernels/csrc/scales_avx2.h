// A record's scales and minimum for rows 8h..8h+7 as AVX2 vectors, read as the type's traits
// say (blocks.h): the AVX2 kernels' epilogue and the dequantized panels.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "blocks.h"

namespace jitney_kernels {
namespace {

inline __m256 load_f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The super-block header's d (which = 0) or dmin (1) of rows 8h..8h+7; zeros for types
// without a header.
template <Kind kKind>
inline __m256 header8(const uint8_t* header, int which, int h) {
  if constexpr (traits(kKind).per_super() > 1) {
    return load_f16x8(header + 32 * which + 16 * h);
  } else {
    return _mm256_setzero_ps();
  }
}

// Sub-block s's scale for rows 8h..8h+7 (dsup: the super-block's d, K-quants).
template <Kind kKind>
inline __m256 scale8(const uint8_t* rec, int s, int h, __m256 dsup) {
  constexpr BlockTraits T = traits(kKind);
  const uint8_t* p = rec + T.scales_offset() + s * T.scale_bytes();
  if constexpr (T.scale == ScaleForm::kF16) {
    return load_f16x8(p + 16 * h);
  } else {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h));
    const __m256i i = T.scale == ScaleForm::kU8 ? _mm256_cvtepu8_epi32(v) : _mm256_cvtepi8_epi32(v);
    return _mm256_mul_ps(dsup, _mm256_cvtepi32_ps(i));
  }
}

// The minimum of rows 8h..8h+7 as a value to add (K-quants: -(dmin * m), exact); zero for
// types without one.
template <Kind kKind>
inline __m256 minimum8(const uint8_t* rec, int h, __m256 msup) {
  constexpr BlockTraits T = traits(kKind);
  const uint8_t* p = rec + T.mins_offset();
  if constexpr (T.min == MinForm::kF16) {
    return load_f16x8(p + 16 * h);
  } else if constexpr (T.min == MinForm::kU8) {
    const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    return _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(msup, _mm256_cvtepi32_ps(m)));
  } else {
    return _mm256_setzero_ps();
  }
}

}  // namespace
}  // namespace jitney_kernels
