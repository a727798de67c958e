// The one-pass kernel with integer dot products on AVX2 (no VNNI): the VNNI kernel's arithmetic
// (quant_vnni.cpp), so the same results bit for bit, with instructions every AVX2 CPU has.
//
// Each activation is the VNNI kernel's two int8 digits joined into one int16, x16 = 254 hi + lo
// (|x16| <= 32385; with one digit, x16 = hi), and vpmaddwd multiplies pairs of int16 quants with
// pairs of int16 activations into int32: 16 multiply-adds an instruction (and an add) where a
// float FMA does 8.
// Past three or four tokens the float one pass (gemv_avx2) is bound by its arithmetic, not by the
// weights' read; that is what a verification step of one sequence and its drafts, or a decode
// batch, pays for on an AVX2 CPU. Measured on Zen 3 (docs/performance.md): 10-20% less time for
// the model's linears at every token count, and no crossover to panels + sgemm up to 1024.
// Unpacking a pair into int16 lanes also takes fewer instructions than into floats, so a tile
// holds 6 tokens (the float kernel's 4).
//
// Per block and token the int32 sum sum(q * x16) is exact (at most 32 * 128 * 32385 < 2^31) and
// equals the VNNI kernel's 254 hi_sum + lo_sum, so its float32 conversion rounds the same exact
// value the VNNI epilogue's fma does; the epilogue then runs the same operations in the same
// order: a token's result is the same in any batch, and the same as on a VNNI CPU.
//
// Lanes: a 32-bit lane holds one row's two consecutive elements (2p, 2p+1) as int16, eight rows a
// register, so a record's pair p is two registers (rows 0-7, 8-15), unpacked once per tile of
// tokens from the element-major record (blocks.h). Every type is one instance of one kernel,
// reading its traits: a bit plane's bits are picked per lane by one vpshufb, tested against the
// lane's bit and added in; the type's offset comes off the levels in the register (u - offset,
// signed), which gives the VNNI kernel's integer sums exactly; sub-blocks of 16 (Q6_K) end
// their sums after eight pairs.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "blocks.h"
#include "scales_avx2.h"
#include "vec_avx2.h"

namespace jitney_kernels {
namespace {

// vpshufb indices picking, for int16 lane L of register h (row 8h + L/2), the byte of a bit
// plane's quad word that holds the row's bits (byte 4h + L/4; the high byte of each lane 0), and
// per pair parity the lane's bit within that byte (4 (row % 2) + 2 (p % 2) + L % 2).
struct PlaneLanes {
  alignas(32) uint8_t shuffle[2][32];
  alignas(32) uint16_t bit[2][16];
  constexpr PlaneLanes() : shuffle{}, bit{} {
    for (int h = 0; h < 2; ++h) {
      for (int L = 0; L < 16; ++L) {
        shuffle[h][2 * L] = static_cast<uint8_t>(4 * h + L / 4);
        shuffle[h][2 * L + 1] = 0x80;
      }
    }
    for (int odd = 0; odd < 2; ++odd) {
      for (int L = 0; L < 16; ++L) bit[odd][L] = static_cast<uint16_t>(1 << (4 * (L / 2 % 2) + 2 * odd + L % 2));
    }
  }
};
constexpr PlaneLanes kPlaneLanes;

// Pair p of a record (elements 2p, 2p+1 of its 16 rows) as int16 pairs of signed quants
// (u - offset): rows 0-7 in lo, 8-15 in hi.
template <Kind kKind>
inline void pair_i16(const uint8_t* rec, int p, __m256i& lo, __m256i& hi) {
  constexpr BlockTraits T = traits(kKind);
  if constexpr (T.lo_bits == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i even = _mm_and_si128(v, mask), odd = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    lo = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(even, odd));
    hi = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(even, odd));
#pragma GCC unroll 2
    for (int k = 0; k < T.hi_planes; ++k) {
      const __m128i word = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + T.lo_bytes() + 64 * k + 8 * (p / 2)));
      const __m256i both = _mm256_broadcastsi128_si256(word);
      const __m256i bit = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPlaneLanes.bit[p % 2]));
      const __m256i add = _mm256_set1_epi16(static_cast<int16_t>(16 << k));
      const __m256i* shuffle = reinterpret_cast<const __m256i*>(kPlaneLanes.shuffle);
      const __m256i l = _mm256_shuffle_epi8(both, _mm256_load_si256(shuffle));
      const __m256i h = _mm256_shuffle_epi8(both, _mm256_load_si256(shuffle + 1));
      lo = _mm256_add_epi16(lo, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(l, bit), bit), add));
      hi = _mm256_add_epi16(hi, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, bit), bit), add));
    }
    if constexpr (T.offset != 0) {
      lo = _mm256_sub_epi16(lo, _mm256_set1_epi16(T.offset));
      hi = _mm256_sub_epi16(hi, _mm256_set1_epi16(T.offset));
    }
  } else {
    const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * p));
    const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * p + 16));
    lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(even, odd));
    hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(even, odd));
  }
}

// A tile of TT tokens (1-6: two int32 sums a token, two registers of quants and one broadcast
// fill AVX2's sixteen) of group g. Float accumulators stay in L1, as gemv_group_avx2's.
template <Kind kKind, int TT>
void gemv_group_int(const PackedMatrix& w, int64_t g, const int16_t* x, const float* scale,
                    const float* sx, int64_t t0, float* y, int64_t ldy) {
  constexpr BlockTraits T = traits(kKind);
  constexpr int P = T.per_super(), kPairs = 16 / T.subs;
  const int64_t K = w.K(), NB = w.NB, NS = NB / P, R = T.record_bytes();
  const uint8_t* end = w.base + w.bytes();
  alignas(32) float acc[TT][kGroup] = {};
  const uint8_t* sup = w.base + g * NS * T.super_bytes();
  for (int64_t si = 0; si < NS; ++si, sup += T.super_bytes()) {
    __m256 dsup[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, msup[2] = {dsup[0], dsup[0]};
    if constexpr (P > 1) {
      for (int h = 0; h < 2; ++h) dsup[h] = load_f16x8(sup + 16 * h);
    }
    if constexpr (T.min == MinForm::kU8) {
      for (int h = 0; h < 2; ++h) msup[h] = load_f16x8(sup + 32 + 16 * h);
    }
    const uint8_t* rec = sup + T.header_bytes();
    for (int r = 0; r < P; ++r, rec += R) {
      const int64_t b = si * P + r;
      const uint8_t* ahead = rec + kPrefetchRecords * R;
      if (ahead < end) {
        for (int64_t off = 0; off < R; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
      }
      const int16_t* xb = x + t0 * K + b * kBlock;
#pragma GCC unroll 2
      for (int s = 0; s < T.subs; ++s) {
        __m256i sum[TT][2];
        for (int t = 0; t < TT; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int pp = 0; pp < kPairs; ++pp) {
          const int p = s * kPairs + pp;
          __m256i q[2];
          pair_i16<kKind>(rec, p, q[0], q[1]);
#pragma GCC unroll 6
          for (int t = 0; t < TT; ++t) {
            int32_t pair;
            __builtin_memcpy(&pair, xb + t * K + 2 * p, 4);
            const __m256i xp = _mm256_set1_epi32(pair);
            sum[t][0] = _mm256_add_epi32(sum[t][0], _mm256_madd_epi16(q[0], xp));
            sum[t][1] = _mm256_add_epi32(sum[t][1], _mm256_madd_epi16(q[1], xp));
            // Integer adds reassociate: unasked, GCC keeps all sixteen pairs' products on the
            // stack to add them as a tree. This keeps each sum in its register, one add per
            // product.
            __asm__("" : "+x"(sum[t][0]), "+x"(sum[t][1]));
          }
        }
        for (int h = 0; h < 2; ++h) {
          const __m256 d = scale8<kKind>(rec, s, h, dsup[h]);
          for (int t = 0; t < TT; ++t) {
            const int64_t tb = (t0 + t) * NB + b;
            const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t][h]),
                                             _mm256_mul_ps(d, _mm256_set1_ps(scale[tb])),
                                             _mm256_load_ps(acc[t] + 8 * h));
            _mm256_store_ps(acc[t] + 8 * h, a);
          }
        }
      }
      if constexpr (T.min != MinForm::kNone) {
        for (int h = 0; h < 2; ++h) {
          for (int t = 0; t < TT; ++t) {
            const int64_t tb = (t0 + t) * NB + b;
            const __m256 a = _mm256_fmadd_ps(minimum8<kKind>(rec, h, msup[h]),
                                             _mm256_set1_ps(sx[tb]), _mm256_load_ps(acc[t] + 8 * h));
            _mm256_store_ps(acc[t] + 8 * h, a);
          }
        }
      }
    }
  }
  const int64_t rows = w.rows_in(g);
  for (int t = 0; t < TT; ++t) std::copy(acc[t], acc[t] + rows, y + (t0 + t) * ldy + g * kGroup);
}

template <Kind kKind>
void gemv_kind(const PackedMatrix& w, const Int16Activations& x, const float* sx, int64_t T,
               float* y, int64_t ldy, int64_t g0, int64_t g1) {
  // Group-major: a group's records stay in L1 for every tile of tokens after the first.
  for (int64_t g = g0; g < g1; ++g) {
    token_tiles<kInt16Tile>(T, [&](auto tile, int64_t t0) {
      constexpr int TT = decltype(tile)::value;
      gemv_group_int<kKind, TT>(w, g, x.values, x.scale, sx, t0, y, ldy);
    });
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

}  // namespace

void quantize_activations_int16(const float* x, int64_t T, int64_t K, Int16Activations& out) {
  // quant_vnni.cpp's quantize_activations, operation for operation, with hi and lo joined.
  const __m256 sign = _mm256_set1_ps(-0.0f), base = _mm256_set1_ps(254.0f);
  const __m256i base_i = _mm256_set1_epi32(254);
  for (int64_t i = 0; i < T * (K / kBlock); ++i) {
    const float* b = x + i * kBlock;
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(b));
    for (int k = 8; k < kBlock; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(b + k)));
    const float amax = hmax(m);
    const bool two = out.digits == 2;
    out.scale[i] = two ? amax / 127.0f / 254.0f : amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i joined[4], hi_sum = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(b + 8 * k), inv);
      const __m256 vh = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i qh = _mm256_cvtps_epi32(vh);
      if (two) {
        const __m256i ql = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(v, vh), base));
        joined[k] = _mm256_add_epi32(_mm256_mullo_epi32(qh, base_i), ql);
      } else {
        joined[k] = qh;
        hi_sum = _mm256_add_epi32(hi_sum, qh);
      }
    }
    if (!two) {  // VNNI's rounded_sum: the same int32 total, the same float product
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), hi_sum);
      int32_t total = 0;
      for (const int32_t lane : lanes) total += lane;
      out.rounded_sum[i] = out.scale[i] * static_cast<float>(total);
    }
    // packs interleaves 128-bit lanes; the permute puts the values back in order.
    for (int k = 0; k < 2; ++k) {
      const __m256i packed = _mm256_permute4x64_epi64(
          _mm256_packs_epi32(joined[2 * k], joined[2 * k + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.values + i * kBlock + 16 * k), packed);
    }
  }
}

void gemv_avx2_int16(const PackedMatrix& w, const Int16Activations& x, const float* sx, int64_t T,
                     float* y, int64_t ldy, int64_t g0, int64_t g1) {
  with_kind(w.kind, [&](auto kind) { gemv_kind<decltype(kind)::value>(w, x, sx, T, y, ldy, g0, g1); });
}

}  // namespace jitney_kernels
