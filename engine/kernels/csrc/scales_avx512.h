// A record's scales and minimum for its 16 rows as AVX-512 vectors, read as the type's traits
// say (blocks.h): the kernels' epilogue. Included after a file's AVX-512 target pragma; an
// anonymous namespace gives each file its own copy, compiled for its own instruction set.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "blocks.h"

namespace jitney_kernels {
namespace {

inline __m512 load_f16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i load_u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m512i load_i8x16(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Sub-block s's scale (dsup: the super-block's d, K-quants; d * sc is exact in float32).
template <Kind kKind>
inline __m512 scale_vec(const uint8_t* rec, int s, __m512 dsup) {
  constexpr BlockTraits T = traits(kKind);
  const uint8_t* p = rec + T.scales_offset() + s * T.scale_bytes();
  if constexpr (T.scale == ScaleForm::kF16) {
    return load_f16(p);
  } else {
    const __m512i i = T.scale == ScaleForm::kU8 ? load_u8x16(p) : load_i8x16(p);
    return _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(i));
  }
}

// acc + minimum * s (msup: the super-block's dmin; a K-quant's minimum is -(dmin * m), and
// fnmadd rounds acc - dmin m s as fmadd rounds acc + (-dmin m) s).
template <Kind kKind>
inline __m512 add_minimum(const uint8_t* rec, __m512 msup, __m512 s, __m512 acc) {
  constexpr BlockTraits T = traits(kKind);
  const uint8_t* p = rec + T.mins_offset();
  if constexpr (T.min == MinForm::kF16) {
    return _mm512_fmadd_ps(load_f16(p), s, acc);
  } else {
    return _mm512_fnmadd_ps(_mm512_mul_ps(msup, _mm512_cvtepi32_ps(load_u8x16(p))), s, acc);
  }
}

}  // namespace
}  // namespace jitney_kernels
