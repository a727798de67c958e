// The AVX-512 and AMX kernels for the packed blocks (blocks.h). Compiled into the same library as
// the AVX2 ones, under a target pragma, and called only where the CPU has these instruction sets
// (cpu_isa.cpp decides), so the library still loads and runs on an AVX2-only CPU.
//
// gemv_avx512: a few tokens at a time (the decode steps), float32 activations kept exact. Each
//   record is unpacked once into two vectors per element pair (the pair's 16 rows each) and used
//   for up to eight tokens; every sub-block's partial sums are scaled by its scale (and the
//   block's minimum times the token's block sum added) at the end of the block. Every type is one
//   instance, reading its traits (blocks.h). The weights stream from memory
//   once per call, so one token costs about their read.
// amx_linear (Q4_1 and Q8_0; other types take the VNNI one pass on an AMX CPU): many tokens at a
//   time (prefill chunks, large decode batches). Each record is
//   dequantized to bf16 in the tile layout AMX takes for its B operand (pairs of elements of one
//   row side by side, the 16 rows across), and tiles of 16 tokens x 32 elements of x (bf16) are
//   multiplied into float32 accumulator tiles of 16 tokens x 16 rows: C[t, n] += sum_k x[t, k]
//   w[n, k]. bf16 keeps 8 bits of mantissa, so this path's products are those of a bf16 matmul.

#include <ATen/Parallel.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "blocks.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma,bmi2,amx-tile,amx-bf16")
#include <immintrin.h>

#include "scales_avx512.h"

namespace jitney_kernels {
namespace {

// Element pair p of a record as two float vectors (element 2p and 2p+1, the 16 rows across),
// the signed quants u - offset (not yet scaled). A bit plane adds its bit where the pair's
// lanes have it: pext gathers those sixteen bits of the quad's word into a lane mask.
template <Kind kKind>
inline void pair_quants(const uint8_t* rec, int p, __m512& even, __m512& odd) {
  constexpr BlockTraits T = traits(kKind);
  if constexpr (T.lo_bits == 4) {
    const __m512i v = load_u8x16(rec + 16 * p);
    __m512i e = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));
    __m512i o = _mm512_srli_epi32(v, 4);
#pragma GCC unroll 2
    for (int k = 0; k < T.hi_planes; ++k) {
      uint64_t word;
      std::memcpy(&word, rec + T.lo_bytes() + 64 * k + 8 * (p / 2), 8);
      const uint64_t lanes = 0x1111111111111111ULL << (2 * (p % 2));
      const __m512i bit = _mm512_set1_epi32(16 << k);
      e = _mm512_mask_add_epi32(e, static_cast<__mmask16>(_pext_u64(word, lanes)), e, bit);
      o = _mm512_mask_add_epi32(o, static_cast<__mmask16>(_pext_u64(word, lanes << 1)), o, bit);
    }
    if constexpr (T.offset != 0) {
      e = _mm512_sub_epi32(e, _mm512_set1_epi32(T.offset));
      o = _mm512_sub_epi32(o, _mm512_set1_epi32(T.offset));
    }
    even = _mm512_cvtepi32_ps(e);
    odd = _mm512_cvtepi32_ps(o);
  } else {
    even = _mm512_cvtepi32_ps(load_i8x16(rec + 32 * p));
    odd = _mm512_cvtepi32_ps(load_i8x16(rec + 32 * p + 16));
  }
}

// TT tokens (1-8), each with C independent partial sums per sub-block (C = 4 breaks the chain of
// 32 multiply-adds a block would otherwise be for one token; with more tokens there is enough
// independent work with 2). At 8 tokens: 3 x 8 accumulators, within AVX-512's 32 registers.
template <Kind kKind, int TT, int C>
void gemv_group(const PackedMatrix& w, int64_t g, const float* x, const float* sx, int64_t t0,
                float* y, int64_t ldy) {
  constexpr BlockTraits T = traits(kKind);
  constexpr int P = T.per_super(), kPairs = 16 / T.subs;
  const int64_t K = w.K(), NB = w.NB, NS = NB / P, R = T.record_bytes();
  const uint8_t* end = w.base + w.bytes();
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
      const float* xb = x + t0 * K + b * kBlock;
#pragma GCC unroll 2
      for (int s = 0; s < T.subs; ++s) {
        __m512 part[TT][C];
        for (int t = 0; t < TT; ++t)
          for (int c = 0; c < C; ++c) part[t][c] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int pp = 0; pp < kPairs; ++pp) {
          const int p = s * kPairs + pp;
          __m512 even, odd;
          pair_quants<kKind>(rec, p, even, odd);
          const int e = C == 4 ? 2 * (pp & 1) : 0;  // this pair's two partial sums: e and e + 1
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            const float* xt = xb + t * K + 2 * p;
            part[t][e] = _mm512_fmadd_ps(even, _mm512_set1_ps(xt[0]), part[t][e]);
            part[t][e + 1] = _mm512_fmadd_ps(odd, _mm512_set1_ps(xt[1]), part[t][e + 1]);
          }
        }
        const __m512 d = scale_vec<kKind>(rec, s, dsup);
        for (int t = 0; t < TT; ++t) {
          __m512 v = _mm512_add_ps(part[t][0], part[t][1]);
          if constexpr (C == 4) v = _mm512_add_ps(v, _mm512_add_ps(part[t][2], part[t][3]));
          acc[t] = _mm512_fmadd_ps(v, d, acc[t]);
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
void gemv_kind(const PackedMatrix& w, const float* x, const float* sx, int64_t T, float* y,
               int64_t ldy, int64_t g0, int64_t g1) {
  // Group-major: a group's records (a few KiB) stay in L1 for every tile of tokens after the first.
  // Tiles of up to 8 tokens (each unpacked pair serves them all; a verification step of one
  // sequence and its drafts is one tile).
  for (int64_t g = g0; g < g1; ++g) {
    token_tiles<8>(T, [&](auto tile, int64_t t0) {
      constexpr int TT = decltype(tile)::value;
      gemv_group<kKind, TT, (TT <= 2 ? 4 : 2)>(w, g, x, sx, t0, y, ldy);
    });
  }
}

// ---- AMX ----------------------------------------------------------------------------------------

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 tokens x 16 rows, float32); 4-5: A (16 tokens x 32 elements of x, bf16);
// 6-7: B (16 element pairs x 16 rows x 2, bf16). Every tile is 16 rows of 64 bytes.
inline void configure_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  // GCC does not see ldtilecfg read the config and may drop stores to it (it dropped the colsb of
  // a config built like this one in a trial kernel; ldtilecfg then faults): keep them.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Up to this many tiles of 16 tokens, each record is dequantized just before its use; with more,
// a pair of groups' whole panel is dequantized once and read by every token tile (measured: the
// panel costs ~25% more at 1-2 token tiles, where it is read only once).
constexpr int64_t kStreamTokenTiles = 2;
// One record as a B tile: row p holds (w[n, 2p], w[n, 2p+1]) in bf16 for the 16 rows n.
template <Kind kKind>
inline void record_to_tile(const uint8_t* rec, uint16_t* tile) {
  static_assert(kKind == Kind::kQ4_1 || kKind == Kind::kQ8_0, "AMX's tiles take Q4_1 and Q8_0");
  constexpr BlockTraits T = traits(kKind);
  const __m512 d = load_f16(rec + T.scales_offset());
  __m512 m = _mm512_setzero_ps();
  if constexpr (kKind == Kind::kQ4_1) m = load_f16(rec + T.mins_offset());
  // cvtne2ps puts the even elements in words 0-15 and the odd ones in 16-31; pairs interleave them.
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) {
    __m512 even, odd;
    pair_quants<kKind>(rec, p, even, odd);
    if constexpr (kKind == Kind::kQ4_1) {
      even = _mm512_fmadd_ps(even, d, m);
      odd = _mm512_fmadd_ps(odd, d, m);
    } else {
      even = _mm512_mul_ps(even, d);
      odd = _mm512_mul_ps(odd, d);
    }
    const __m512i bf = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
    _mm512_store_si512(reinterpret_cast<__m512i*>(tile + 32 * p), _mm512_permutexvar_epi16(pairs, bf));
  }
}

// C tile `c` (16 tokens x 16 rows) into y: tokens [t0, t0 + 16) of which `tokens` exist, rows of
// group g of which `rows` exist; whole tiles are stored straight into y.
inline void store_c(int c, float* y, int64_t ldy, int64_t t0, int64_t tokens, int64_t g,
                    int64_t rows, float* scratch) {
  float* dst = y + t0 * ldy + g * kGroup;
  if (tokens == 16 && rows == 16) {
    switch (c) {
      case 0: _tile_stored(0, dst, ldy * 4); break;
      case 1: _tile_stored(1, dst, ldy * 4); break;
      case 2: _tile_stored(2, dst, ldy * 4); break;
      default: _tile_stored(3, dst, ldy * 4); break;
    }
    return;
  }
  switch (c) {
    case 0: _tile_stored(0, scratch, 64); break;
    case 1: _tile_stored(1, scratch, 64); break;
    case 2: _tile_stored(2, scratch, 64); break;
    default: _tile_stored(3, scratch, 64); break;
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  for (int64_t t = 0; t < tokens; ++t) {
    _mm512_mask_storeu_ps(dst + t * ldy, mask, _mm512_loadu_ps(scratch + 16 * t));
  }
}

// Groups g and g+1 (`two` = g+1 exists) for all tokens. `tiles` holds the dequantized records:
// with few tokens (one or two token tiles) each record is dequantized just before its use;
// with more, the pair's whole panel is dequantized once and every token tile reads it.
template <Kind kKind>
void amx_pair(const PackedMatrix& w, int64_t g, bool two, const uint16_t* xb, int64_t T, float* y,
              int64_t ldy, uint16_t* tiles, float* scratch) {
  const int64_t K = w.K(), NB = w.NB;
  const int64_t token_tiles = (T + 15) / 16;
  const bool panel = token_tiles > kStreamTokenTiles;
  if (panel) {
    for (int64_t b = 0; b < NB; ++b) {
      record_to_tile<kKind>(w.record(g, b), tiles + b * 512);
      if (two) record_to_tile<kKind>(w.record(g + 1, b), tiles + (NB + b) * 512);
    }
  }
  for (int64_t j = 0; j < token_tiles; j += 2) {
    const bool pair_of_tokens = j + 1 < token_tiles;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* a0 = xb + j * 16 * K;
    const uint16_t* a1 = a0 + 16 * K;
    for (int64_t b = 0; b < NB; ++b) {
      const uint16_t* b0 = tiles + b * 512;
      const uint16_t* b1 = tiles + (NB + b) * 512;
      if (!panel) {
        b0 = tiles;
        b1 = tiles + 512;
        record_to_tile<kKind>(w.record(g, b), tiles);
        if (two) record_to_tile<kKind>(w.record(g + 1, b), tiles + 512);
      }
      _tile_loadd(4, a0 + b * kBlock, K * 2);
      _tile_loadd(6, b0, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two) {
        _tile_loadd(7, b1, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (pair_of_tokens) {
        _tile_loadd(5, a1 + b * kBlock, K * 2);
        _tile_dpbf16ps(2, 5, 6);
        if (two) _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int64_t t0 = j * 16;
    store_c(0, y, ldy, t0, std::min<int64_t>(16, T - t0), g, w.rows_in(g), scratch);
    if (two) store_c(1, y, ldy, t0, std::min<int64_t>(16, T - t0), g + 1, w.rows_in(g + 1), scratch);
    if (pair_of_tokens) {
      const int64_t t1 = t0 + 16;
      store_c(2, y, ldy, t1, std::min<int64_t>(16, T - t1), g, w.rows_in(g), scratch);
      if (two) store_c(3, y, ldy, t1, std::min<int64_t>(16, T - t1), g + 1, w.rows_in(g + 1), scratch);
    }
  }
}

template <Kind kKind>
void amx_kind(const PackedMatrix& w, const uint16_t* xb, int64_t T, float* y, int64_t ldy) {
  const int64_t pairs = (w.G + 1) / 2;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pairs));
  const bool panel = (T + 15) / 16 > kStreamTokenTiles;
  // Whole pairs per thread, contiguous, so each streams one long run of the matrix.
  const int64_t per = (pairs + threads - 1) / threads;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    static thread_local std::vector<uint16_t> buffer;  // kept: no allocation per call
    buffer.resize((panel ? 2 * w.NB : 2) * 512 + 32);
    // 64-byte aligned: the tile stores above are aligned stores.
    uint16_t* tiles = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    alignas(64) float scratch[256];
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t p = i * per; p < std::min(pairs, (i + 1) * per); ++p) {
        const int64_t g = 2 * p;
        amx_pair<kKind>(w, g, g + 1 < w.G, xb, T, y, ldy, tiles, scratch);
      }
    }
    _tile_release();
  });
}

}  // namespace

void gemv_avx512(const PackedMatrix& w, const float* x, const float* sx, int64_t T, float* y,
                 int64_t ldy, int64_t g0, int64_t g1) {
  with_kind(w.kind, [&](auto kind) { gemv_kind<decltype(kind)::value>(w, x, sx, T, y, ldy, g0, g1); });
}

void amx_linear(const PackedMatrix& w, const uint16_t* xb, int64_t T, float* y, int64_t ldy) {
  if (w.kind == Kind::kQ4_1) {
    amx_kind<Kind::kQ4_1>(w, xb, T, y, ldy);
  } else {
    amx_kind<Kind::kQ8_0>(w, xb, T, y, ldy);
  }
}

void to_bf16_rows(const float* x, int64_t T, int64_t K, uint16_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; k += 32) {
      const __m512 a = _mm512_loadu_ps(x + t * K + k), b = _mm512_loadu_ps(x + t * K + k + 16);
      _mm512_storeu_si512(reinterpret_cast<__m512i*>(out + t * K + k),
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
    }
  }
}

}  // namespace jitney_kernels

#pragma GCC pop_options
