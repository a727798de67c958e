// The one-pass kernel with integer dot products (AVX-512 VNNI and VBMI): a few tokens at a time,
// as gemv_avx512, but each token's activations are first rounded to integers per block of 32 and
// each record's quants are multiplied with them four at a time by vpdpbusd (unsigned weight
// bytes times signed activation bytes, summed into int32). A 16-lane float FMA does 16
// multiply-adds, a vpdpbusd 64: past one or two tokens the float kernel is bound by its FMAs,
// not by the weights' read, which is what a verification step of one sequence and its drafts
// (or a small decode batch) pays for.
//
// Each activation is two int8 digits by default: x ~ dx * (hi + lo / 254), dx = max|x| / 127
// over the block, hi = round(x / dx), lo = round((x / dx - hi) * 254): about 15 bits, within
// 1.5e-5 of the block's largest value, for two vpdpbusd per token and four elements; greedy
// tokens match the dense model's. With one digit (`--activation-digits 1`, llama.cpp's Q8
// activations) x ~ dx * hi, one vpdpbusd: 1.5x the tokens/s of a 64-request trace on a
// Zen 4, for +0.3% perplexity and 3% of greedy tokens unlike the dense model's
// (docs/performance.md). The digits are the process's setting (cpu_isa.cpp).
//
// Per block and token the integer sums are exact; the block's float epilogue is
// d * dx / 254 * (254 hi_sum + lo_sum), or d * dx * hi_sum with one digit (+ m * sum for Q4_1:
// with two digits the sum of the exact activations, with one the sum of the rounded ones,
// dx * hi_sum, whose rounding errors then meet the weights as d q + m, centred, rather than as
// the quants q alone: 4x less error on SmolLM2's matrices), in the same order for every token,
// so a token's result does not depend on the others in the call. reference.py's
// quant_linear_int8_activations is the same arithmetic.
//
// Lanes are the record's 16 rows, as everywhere (blocks.h); vpdpbusd wants each lane to hold
// four consecutive elements of its row, which one vpermb (and for nibbles one vpmultishiftqb to
// pick them) makes out of the element-major record; each bit plane (5- and 6-bit types) is one
// 64-bit mask whose bit 4r + i is lane r's byte i, added in by one masked byte add.
//
// Every type is one instance of one kernel, reading its traits (blocks.h): the levels u are
// unsigned, so a type's offset (Q4_0's 8, Q5_0's 16, Q6_K's 32, and 128 for Q8_0's int8 quants
// read as u = q + 128) comes off each sub-block's integer sums exactly: they start at -offset
// times the activations' digits' sum over the sub-block, worked out once a projection per token
// (offset_starts), not subtracted per row group (two scalar products, two broadcasts and two
// subtractions per token and sub-block, which cost Q6_K as much as its dot products); the scale
// per sub-block (an f16, or a K-quant's integer times its super-block's d, exact in float32)
// and the minimum then enter the float epilogue.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "blocks.h"

namespace jitney_kernels {
namespace {

// vpermb indices, constant (no code runs when the library loads, so a CPU without AVX-512 loads it too). Q4_1: a 64-byte load holds pairs 4h..4h+3 ([pair][16 rows]); for
// elements 4j..4j+3 (pairs 2j, 2j+1: s = j - 2h picks which two of the four) lane r gets bytes
// (pair 2j, row r), (pair 2j+1, row r) in its low two bytes. Q8_0: a 64-byte load holds elements
// 4j..4j+3 ([element][16 rows]); lane r gets its row's four.
struct Indices {
  alignas(64) uint8_t q4[2][64];
  alignas(64) uint8_t q8[64];
  constexpr Indices() : q4{}, q8{} {
    for (int r = 0; r < 16; ++r) {
      for (int s = 0; s < 2; ++s) {
        q4[s][4 * r] = static_cast<uint8_t>(32 * s + r);
        q4[s][4 * r + 1] = static_cast<uint8_t>(32 * s + 16 + r);
        q4[s][4 * r + 2] = q4[s][4 * r + 3] = 0;  // not read by the nibble shifts
      }
      for (int e = 0; e < 4; ++e) q8[4 * r + e] = static_cast<uint8_t>(16 * e + r);
    }
  }
};
constexpr Indices kIndices;

}  // namespace
}  // namespace jitney_kernels

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c,fma,bmi2")
#include <immintrin.h>

#include "scales_avx512.h"

namespace jitney_kernels {
namespace {

// Per 64-bit pair of lanes, the bit offsets of the four nibbles of each lane's two bytes:
// lane bytes (b0, b1) -> (b0 & 15, b0 >> 4, b1 & 15, b1 >> 4) once masked with 0x0F.
constexpr int64_t kNibbleShifts = 0x2C2824200C080400LL;

// Elements 4j..4j+3 of the record's 16 rows as unsigned bytes (levels u), four per lane
// (Q8_0: q + 128).
template <Kind kKind>
inline __m512i quads(const uint8_t* rec, int j) {
  constexpr BlockTraits T = traits(kKind);
  if constexpr (T.lo_bits == 4) {
    const __m512i v = _mm512_loadu_si512(rec + 64 * (j / 2));
    const __m512i idx = _mm512_load_si512(kIndices.q4[j % 2]);
    const __m512i bytes = _mm512_permutexvar_epi8(idx, v);
    __m512i q = _mm512_and_si512(
        _mm512_multishift_epi64_epi8(_mm512_set1_epi64(kNibbleShifts), bytes),
        _mm512_set1_epi8(0x0F));
#pragma GCC unroll 2
    for (int k = 0; k < T.hi_planes; ++k) {
      uint64_t bits;
      __builtin_memcpy(&bits, rec + T.lo_bytes() + 64 * k + 8 * j, 8);
      q = _mm512_mask_add_epi8(q, _cvtu64_mask64(bits), q, _mm512_set1_epi8(static_cast<char>(16 << k)));
    }
    return q;
  } else {
    const __m512i v = _mm512_loadu_si512(rec + 64 * j);
    const __m512i w = _mm512_permutexvar_epi8(_mm512_load_si512(kIndices.q8), v);
    return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));  // int8 -> w + 128
  }
}

// The offset of a type's levels as the kernel reads them (Q8_0's int8 quants as u = q + 128).
template <Kind kKind>
constexpr int kLevelOffset = traits(kKind).offset + (traits(kKind).lo_bits == 8 ? 128 : 0);

// TT tokens (1-8) of group g, C independent integer sums per sub-block and token (C = 2 breaks
// the chain of dependent vpdpbusd a block is for one or two tokens). start: where each token's
// sums per sub-block begin (offset_starts), nullptr for a type without an offset.
template <Kind kKind, int TT, int C, int kDigits>
void gemv_group(const PackedMatrix& w, int64_t g, const TiledDigits& x, const int32_t* start,
                const float* sx, int64_t t0, float* y, int64_t ldy) {
  constexpr BlockTraits T = traits(kKind);
  constexpr int P = T.per_super(), kQuads = 8 / T.subs;
  constexpr int kOffset = kLevelOffset<kKind>;
  const int64_t K = w.K(), NB = w.NB, NS = NB / P, R = T.record_bytes();
  const uint8_t* end = w.base + w.bytes();
  // This tile's activations, scales and starts (TiledDigits): each at a constant offset from
  // one pointer a block, so the unrolled loop below computes no addresses.
  const int8_t* tile_digits = x.digits + t0 * K * kDigits;
  const float* tile_scale = x.scale + t0 * NB;
  const int32_t* tile_start = start ? start + 2 * t0 * NB * T.subs : nullptr;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  const uint8_t* sup = w.base + g * NS * T.super_bytes();
  for (int64_t si = 0; si < NS; ++si, sup += T.super_bytes()) {
    __m512 dsup = _mm512_setzero_ps(), msup = _mm512_setzero_ps();
    if constexpr (P > 1) dsup = load_f16(sup);
    if constexpr (T.min == MinForm::kU8) msup = load_f16(sup + 32);
    const uint8_t* rec = sup + T.header_bytes();
    for (int r = 0; r < P; ++r, rec += R) {
      const int64_t b = si * P + r;
      const uint8_t* ahead = rec + kPrefetchRecords * R;
      if (ahead < end) {
        for (int64_t off = 0; off < R; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
      }
      const int8_t* xb = tile_digits + b * kBlock * TT * kDigits;
#pragma GCC unroll 2
      for (int s = 0; s < T.subs; ++s) {
        __m512i hi[TT][C], lo[TT][C];
        const int32_t* st = tile_start + 2 * (b * T.subs + s) * TT;
        for (int t = 0; t < TT; ++t) {
          for (int c = 0; c < C; ++c) hi[t][c] = lo[t][c] = _mm512_setzero_si512();
          if constexpr (kOffset != 0) {  // the levels were read as u: start at -offset * sum(x)
            hi[t][0] = _mm512_set1_epi32(st[2 * t]);
            if constexpr (kDigits == 2) lo[t][0] = _mm512_set1_epi32(st[2 * t + 1]);
          }
        }
#pragma GCC unroll 8
        for (int jj = 0; jj < kQuads; ++jj) {
          const int j = s * kQuads + jj;
          const __m512i wq = quads<kKind>(rec, j);
          const int c = jj % C;
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            const int8_t* xq = xb + (j * TT + t) * 4 * kDigits;
            int32_t h;
            __builtin_memcpy(&h, xq, 4);
            hi[t][c] = _mm512_dpbusd_epi32(hi[t][c], wq, _mm512_set1_epi32(h));
            if constexpr (kDigits == 2) {
              int32_t l;
              __builtin_memcpy(&l, xq + 4, 4);
              lo[t][c] = _mm512_dpbusd_epi32(lo[t][c], wq, _mm512_set1_epi32(l));
            }
          }
        }
        const __m512 d = scale_vec<kKind>(rec, s, dsup);
        for (int t = 0; t < TT; ++t) {
          __m512i sh = hi[t][0], sl = lo[t][0];
          if constexpr (C == 2) {
            sh = _mm512_add_epi32(sh, hi[t][1]);
            sl = _mm512_add_epi32(sl, lo[t][1]);
          }
          __m512 v = _mm512_cvtepi32_ps(sh);
          if constexpr (kDigits == 2) v = _mm512_fmadd_ps(v, _mm512_set1_ps(254.0f), _mm512_cvtepi32_ps(sl));
          acc[t] = _mm512_fmadd_ps(v, _mm512_mul_ps(d, _mm512_set1_ps(tile_scale[b * TT + t])), acc[t]);
        }
      }
      if constexpr (T.min != MinForm::kNone) {
        for (int t = 0; t < TT; ++t) {
          acc[t] = add_minimum<kKind>(rec, msup, _mm512_set1_ps(sx[(t0 + t) * NB + b]), acc[t]);
        }
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << w.rows_in(g)) - 1);
  for (int t = 0; t < TT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + g * kGroup, mask, acc[t]);
}

template <Kind kKind>
void offset_starts_kind(const Int8Digits& x, int64_t T, int64_t NB, std::vector<int32_t>& starts) {
  constexpr BlockTraits BT = traits(kKind);
  if constexpr (kLevelOffset<kKind> == 0) {
    starts.clear();
    return;
  }
  starts.resize(2 * T * NB * BT.subs);
  for (int64_t t = 0; t < T; ++t) {  // tile by tile, as TiledDigits
    const int64_t t0 = t / kVnniTile * kVnniTile, TT = std::min<int64_t>(kVnniTile, T - t0);
    int32_t* tile = starts.data() + 2 * (t0 * NB * BT.subs + (t - t0));
    for (int64_t b = 0; b < NB; ++b) {
      const int32_t* hs = x.hi_sum16 + 2 * (t * NB + b);
      const int32_t* ls = x.digits == 2 ? x.lo_sum16 + 2 * (t * NB + b) : hs;  // lo unused with one digit
      for (int s = 0; s < BT.subs; ++s) {
        int32_t* out = tile + 2 * (b * BT.subs + s) * TT;
        out[0] = -kLevelOffset<kKind> * (BT.subs == 2 ? hs[s] : hs[0] + hs[1]);
        out[1] = -kLevelOffset<kKind> * (BT.subs == 2 ? ls[s] : ls[0] + ls[1]);
      }
    }
  }
}

template <Kind kKind>
void gemv_kind(const PackedMatrix& w, const TiledDigits& x, const int32_t* start, const float* sx,
               int64_t T, float* y, int64_t ldy, int64_t g0, int64_t g1) {
  // Group-major with tiles of up to 8 tokens, as gemv_avx512.
  for (int64_t g = g0; g < g1; ++g) {
    token_tiles<kVnniTile>(T, [&](auto tile, int64_t t0) {
      constexpr int TT = decltype(tile)::value;
      if (x.per_value == 1) {
        gemv_group<kKind, TT, (TT <= 2 ? 2 : 1), 1>(w, g, x, start, sx, t0, y, ldy);
      } else {
        gemv_group<kKind, TT, (TT <= 2 ? 2 : 1), 2>(w, g, x, start, sx, t0, y, ldy);
      }
    });
  }
}

}  // namespace

void quantize_activations(const float* x, int64_t T, int64_t K, Int8Digits& out) {
  const __m512 base = _mm512_set1_ps(254.0f);
  for (int64_t i = 0; i < T * (K / kBlock); ++i) {
    const float* b = x + i * kBlock;
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(b)), _mm512_abs_ps(_mm512_loadu_ps(b + 16))));
    const bool two = out.digits == 2;
    out.scale[i] = two ? amax / 127.0f / 254.0f : amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int h = 0; h < 2; ++h) {
      // Rounded to nearest, ties to even (the default rounding mode), as torch.round; v - hi is
      // exact in float32.
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(b + 16 * h), inv);
      const __m512 vh = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i qh = _mm512_cvtps_epi32(vh);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.hi + i * kBlock + 16 * h), _mm512_cvtepi32_epi8(qh));
      out.hi_sum16[2 * i + h] = _mm512_reduce_add_epi32(qh);
      if (two) {
        const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, vh), base));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.lo + i * kBlock + 16 * h), _mm512_cvtepi32_epi8(ql));
        out.lo_sum16[2 * i + h] = _mm512_reduce_add_epi32(ql);
      }
    }
    if (!two) {
      const int32_t total = out.hi_sum16[2 * i] + out.hi_sum16[2 * i + 1];
      out.rounded_sum[i] = out.scale[i] * static_cast<float>(total);
    }
  }
}

void tile_digits(const Int8Digits& x, int64_t T, int64_t K, int64_t t_begin, int64_t t_end,
                 TiledDigits& out) {
  const int D = out.per_value;
  const int64_t NB = K / kBlock;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t t0 = t / kVnniTile * kVnniTile, TT = std::min<int64_t>(kVnniTile, T - t0);
    int8_t* dst = out.digits + (t0 * K + (t - t0) * 4) * D;
    for (int64_t q = 0; q < K / 4; ++q) {  // quad q of the token: block q / 8, quad q % 8
      __builtin_memcpy(dst + q * 4 * TT * D, x.hi + t * K + 4 * q, 4);
      if (D == 2) __builtin_memcpy(dst + q * 4 * TT * D + 4, x.lo + t * K + 4 * q, 4);
    }
    float* scale = out.scale + t0 * NB + (t - t0);
    for (int64_t b = 0; b < NB; ++b) scale[b * TT] = x.scale[t * NB + b];
  }
}

void offset_starts(Kind kind, const Int8Digits& x, int64_t T, int64_t NB,
                   std::vector<int32_t>& starts) {
  with_kind(kind, [&](auto k) { offset_starts_kind<decltype(k)::value>(x, T, NB, starts); });
}

void gemv_vnni(const PackedMatrix& w, const TiledDigits& x, const int32_t* start, const float* sx,
               int64_t T, float* y, int64_t ldy, int64_t g0, int64_t g1) {
  with_kind(w.kind, [&](auto kind) {
    gemv_kind<decltype(kind)::value>(w, x, start, sx, T, y, ldy, g0, g1);
  });
}

}  // namespace jitney_kernels

#pragma GCC pop_options
