// y = x @ W.T for weights kept in GGUF's blocks (every type blocks.h's traits table covers,
// packed as it says), and the embedding lookup. A projection is one or more parts, each a matrix
// of its own type side by side in y's columns (a fused Q/K/V or gate/up whose parts the file
// stores in different types keeps each in its blocks); the activations are rounded once for all
// parts, and one parallel region serves every part's groups. This file holds the ops' entry
// points, the choice of path, and the AVX2 kernels every x86-64 CPU the library builds for can
// run; quant_avx512.cpp holds the AVX-512 and AMX ones.
//
// Paths, chosen per call by the number of tokens T and the instruction set in use (cpu_isa.cpp):
//   one pass (T < batched_min_tokens): the weights stream from memory once; each unpacked record
//          serves a few tokens in registers: with VNNI, activations rounded to two int8 digits
//          per block and integer dot products (gemv_vnni); on AVX2 the same arithmetic with
//          vpmaddwd (gemv_avx2_int16, the default); else float32 activations kept exact
//          (gemv_avx512, or gemv_avx2 here when capped to "avx2": tiles of 4 tokens, AVX2's
//          sixteen registers).
//   batched (T >= batched_min_tokens): with AMX, bf16 tiles (amx_linear; Q4_1 and Q8_0, the
//          other types keep the one pass); otherwise each thread dequantizes panels of rows into
//          float32 columns that stay in L2 and multiplies them with MKL's sgemm (at::mm_out).
// batched_min_tokens = 0 takes the crossover measured for the instruction set (kAutoCrossover).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "blocks.h"
#include "ops.h"
#include "scales_avx2.h"
#include "vec_avx2.h"

namespace jitney_kernels {
namespace {

// NOTE: from this many tokens on a linear takes its batched path, per instruction set and kind;
// measured with `python -m research.kernels --crossover` (docs/performance.md has the tables): with
// AMX, the one-pass kernel (tiles of up to 8 tokens) is faster up to 8 tokens and the bf16 tiles
// from 9 (2 threads); on Zen 3's AVX2, the float one pass (unpacking each record once per tile of
// 4 tokens) lost to panels + sgemm from 64-96 tokens on the Q4_1 shapes and from 256 on the Q8_0
// head, but the integer one pass ties or beats them at every T measured, up to 1024 (1.0-1.2x);
// with AVX-512 and no AMX (Zen 4), the one pass (float or VNNI) beat panels + sgemm at every T
// measured, up to 256, by 1.2-1.9x: no batched path.
int64_t auto_crossover(int isa, Kind kind) {
  if (isa >= kAmx) return amx_covers(kind) ? 9 : std::numeric_limits<int64_t>::max();
  if (isa >= kAvx2Int16) return std::numeric_limits<int64_t>::max();
  return kind == Kind::kQ8_0 ? 128 : 64;
}

// Element pair p of a record, rows 8h..8h+7 (h = 0, 1), as float vectors of signed quants
// u - offset (unscaled). A bit plane's bits for these lanes are at 4r + 2 (p % 2) + i of the
// quad's word, r the row: one variable shift of the half's 32 bits per element.
template <Kind kKind>
inline void pair_quants8(const uint8_t* rec, int p, int h, __m256& even, __m256& odd) {
  constexpr BlockTraits T = traits(kKind);
  if constexpr (T.lo_bits == 4) {
    const __m256i v = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 16 * p + 8 * h)));
    __m256i e = _mm256_and_si256(v, _mm256_set1_epi32(0x0F));
    __m256i o = _mm256_srli_epi32(v, 4);
#pragma GCC unroll 2
    for (int k = 0; k < T.hi_planes; ++k) {
      uint32_t half;
      std::memcpy(&half, rec + T.lo_bytes() + 64 * k + 8 * (p / 2) + 4 * h, 4);
      const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
                                              _mm256_set1_epi32(2 * (p % 2)));
      const __m256i word = _mm256_set1_epi32(static_cast<int32_t>(half));
      const __m256i one = _mm256_set1_epi32(1);
      const __m256i eb = _mm256_and_si256(_mm256_srlv_epi32(word, shifts), one);
      const __m256i ob = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_add_epi32(shifts, one)), one);
      e = _mm256_add_epi32(e, _mm256_slli_epi32(eb, 4 + k));
      o = _mm256_add_epi32(o, _mm256_slli_epi32(ob, 4 + k));
    }
    if constexpr (T.offset != 0) {
      e = _mm256_sub_epi32(e, _mm256_set1_epi32(T.offset));
      o = _mm256_sub_epi32(o, _mm256_set1_epi32(T.offset));
    }
    even = _mm256_cvtepi32_ps(e);
    odd = _mm256_cvtepi32_ps(o);
  } else {
    const auto* e = reinterpret_cast<const __m128i*>(rec + 32 * p + 8 * h);
    const auto* o = reinterpret_cast<const __m128i*>(rec + 32 * p + 16 + 8 * h);
    even = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(e)));
    odd = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(o)));
  }
}

// One group for a tile of TT tokens (1-4): each record is unpacked once per tile, pair by pair
// (both halves of its 16 rows: an AVX2 register holds eight), and each unpacked pair serves
// every token of the tile from registers. Per token and half there is one partial sum in every
// tile size: a token's sums then run in the same order whatever else is in the step, so its
// product is bit for bit the same alone or beside others (served text equals offline text; 4 at
// one token was faster but made the rounding depend on the batch, and a fault test's served
// text then left the offline one). Each sub-block's scale (and the block's minimum times the
// token's block sum) scale the partial sums at the end of each sub-block, into accumulators
// kept in L1.
template <Kind kKind, int TT>
void gemv_group_avx2(const PackedMatrix& w, int64_t g, const float* x, const float* sx,
                     int64_t t0, float* y, int64_t ldy) {
  constexpr BlockTraits T = traits(kKind);
  constexpr int kPairs = 16 / T.subs;
  const int64_t K = w.K(), NB = w.NB, R = T.record_bytes();
  const uint8_t* end = w.base + w.bytes();
  alignas(32) float acc[TT][kGroup] = {};
  for_records<kKind>(w, g, [&](const uint8_t* rec, int64_t b, const uint8_t* header) {
    const uint8_t* ahead = rec + kPrefetchRecords * R;
    if (ahead < end) {
      for (int64_t off = 0; off < R; off += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
    }
    const float* xb = x + t0 * K + b * kBlock;
    for (int s = 0; s < T.subs; ++s) {
      __m256 part[TT][2];
      for (int t = 0; t < TT; ++t) part[t][0] = part[t][1] = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int pp = 0; pp < kPairs; ++pp) {
        const int p = s * kPairs + pp;
        __m256 even[2], odd[2];
        pair_quants8<kKind>(rec, p, 0, even[0], odd[0]);
        pair_quants8<kKind>(rec, p, 1, even[1], odd[1]);
#pragma GCC unroll 4
        for (int t = 0; t < TT; ++t) {
          const float* xt = xb + t * K + 2 * p;
          const __m256 x0 = _mm256_set1_ps(xt[0]), x1 = _mm256_set1_ps(xt[1]);
          for (int h = 0; h < 2; ++h) {
            part[t][h] = _mm256_fmadd_ps(even[h], x0, part[t][h]);
            part[t][h] = _mm256_fmadd_ps(odd[h], x1, part[t][h]);
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 d = scale8<kKind>(rec, s, h, header8<kKind>(header, 0, h));
        for (int t = 0; t < TT; ++t) {
          _mm256_store_ps(acc[t] + 8 * h, _mm256_fmadd_ps(part[t][h], d, _mm256_load_ps(acc[t] + 8 * h)));
        }
      }
    }
    if constexpr (T.min != MinForm::kNone) {
      for (int h = 0; h < 2; ++h) {
        const __m256 m = minimum8<kKind>(rec, h, header8<kKind>(header, 1, h));
        for (int t = 0; t < TT; ++t) {
          const __m256 a = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[(t0 + t) * NB + b]), _mm256_load_ps(acc[t] + 8 * h));
          _mm256_store_ps(acc[t] + 8 * h, a);
        }
      }
    }
  });
  const int64_t rows = w.rows_in(g);
  for (int t = 0; t < TT; ++t) std::copy(acc[t], acc[t] + rows, y + (t0 + t) * ldy + g * kGroup);
}

template <Kind kKind>
void gemv_avx2_kind(const PackedMatrix& w, const float* x, const float* sx, int64_t T, float* y,
                    int64_t ldy, int64_t g0, int64_t g1) {
  // Group-major: a group's records (a few KiB) stay in L1 for every tile of tokens after the first.
  for (int64_t g = g0; g < g1; ++g) {
    token_tiles<4>(T, [&](auto tile, int64_t t0) {
      constexpr int TT = decltype(tile)::value;
      gemv_group_avx2<kKind, TT>(w, g, x, sx, t0, y, ldy);
    });
  }
}

template <Kind kKind>
void dequantize_columns_kind(const PackedMatrix& w, int64_t g0, int64_t g1, float* out,
                             int64_t ldo) {
  constexpr BlockTraits T = traits(kKind);
  for (int64_t g = g0; g < g1; ++g) {
    float* col = out + (g - g0) * kGroup;
    for_records<kKind>(w, g, [&](const uint8_t* rec, int64_t b, const uint8_t* header) {
      for (int h = 0; h < 2; ++h) {
        const __m256 m = minimum8<kKind>(rec, h, header8<kKind>(header, 1, h));
        for (int p = 0; p < 16; ++p) {
          const __m256 d = scale8<kKind>(rec, p / (16 / T.subs), h, header8<kKind>(header, 0, h));
          __m256 even, odd;
          pair_quants8<kKind>(rec, p, h, even, odd);
          // scale * (u - offset) is exact in float32 and + minimum rounds once: gguf's
          // dequantize bit for bit.
          const int64_t k = b * kBlock + 2 * p;
          _mm256_storeu_ps(col + k * ldo + 8 * h, _mm256_fmadd_ps(even, d, m));
          _mm256_storeu_ps(col + (k + 1) * ldo + 8 * h, _mm256_fmadd_ps(odd, d, m));
        }
      }
    });
  }
}

// Calls f(begin, end) for consecutive chunks of [0, n), handed out to torch's intra-op threads one
// at a time: a thread that falls behind (another process took its core) holds up one chunk, not
// a static half of the work.
template <class F>
void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  // OpenMP's threads do not inherit the caller's thread-local state (inference mode, grad mode):
  // the panels' at::mm_out would refuse to write an inference tensor without it.
  const at::ThreadLocalState caller;
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const at::ThreadLocalStateGuard state(caller);
    for (int64_t c = next++; c < num_chunks; c = next++) f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// Per-token block sums of x, [T, NB]: the minimum term's other factor.
at::Tensor block_sums(const at::Tensor& x) {
  const int64_t T = x.size(0), K = x.size(1), NB = K / kBlock;
  at::Tensor sx = at::empty({T, NB}, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = sx.data_ptr<float>();
  for (int64_t i = 0; i < T * NB; ++i) {
    const float* b = xp + i * kBlock;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(b), _mm256_loadu_ps(b + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(b + 16), _mm256_loadu_ps(b + 24)));
    sp[i] = hsum(s);
  }
  return sx;
}

// x as int16 activations (quant_avx2_int.cpp), for AVX2's integer one pass: one buffer per
// thread, kept.
struct Int16Buffer {
  std::vector<int16_t> values;
  std::vector<float> scale, rounded_sum;
  Int16Activations view;
  void quantize(const float* x, int64_t T, int64_t K, int digits) {
    values.resize(T * K);
    scale.resize(T * K / kBlock);
    rounded_sum.resize(T * K / kBlock);
    view = {values.data(), scale.data(), rounded_sum.data(), digits};
    quantize_activations_int16(x, T, K, view);
  }
};

// Activations a call rounds on its own thread, below which a parallel region costs more than
// it saves.
constexpr int64_t kParallelRoundingValues = 16384;

// x as int8 digits (quant_vnni.cpp), for the integer-dot one pass: one buffer per thread, kept.
struct Int8Activations {
  std::vector<int8_t> digits, tiled_digits;
  std::vector<float> scale, tiled_scale, rounded_sum;
  std::vector<int32_t> sums;
  Int8Digits view;
  TiledDigits tiled;
  void quantize(const float* x, int64_t T, int64_t K, int num_digits) {
    const int64_t nb = T * K / kBlock;
    digits.resize(num_digits * T * K);
    tiled_digits.resize(num_digits * T * K);
    scale.resize(nb);
    tiled_scale.resize(nb);
    rounded_sum.resize(nb);
    sums.resize(2 * num_digits * nb);
    int8_t* lo = num_digits == 2 ? digits.data() + T * K : nullptr;
    int32_t* lo_sum16 = num_digits == 2 ? sums.data() + 2 * nb : nullptr;
    view = {digits.data(), lo, scale.data(), sums.data(), lo_sum16, rounded_sum.data(), num_digits};
    tiled = {tiled_digits.data(), tiled_scale.data(), num_digits};
    // A batched step's tokens split between the threads: rounded on one, they held the other
    // idle for 2% of a 64-request trace (perf). A few tokens stay on the caller's thread.
    const int64_t min_tokens = std::max<int64_t>(1, kParallelRoundingValues / K);
    at::parallel_for(0, T, min_tokens, [&](int64_t t0, int64_t t1) {
      Int8Digits rows = view.from_token(t0, K);
      quantize_activations(x + t0 * K, t1 - t0, K, rows);
      tile_digits(view, T, K, t0, t1, tiled);
    });
  }
};

// One part of a projection: a packed matrix writing y's columns [col0, col0 + w.N).
struct Part {
  PackedMatrix w;
  int64_t col0;
};

bool has_minimum(const Part& p) { return traits(p.w.kind).min != MinForm::kNone; }

// Calls f(part, g0, g1) for the groups [g0, g1) of each part that global groups [begin, end) of
// the parts' groups, laid end to end, cover.
template <class F>
void for_part_groups(const std::vector<Part>& parts, int64_t begin, int64_t end, const F& f) {
  int64_t first = 0;
  for (const Part& p : parts) {
    const int64_t g0 = std::max<int64_t>(begin - first, 0), g1 = std::min(end - first, p.w.G);
    if (g0 < g1) f(p, g0, g1);
    first += p.w.G;
  }
}

// Every part's one pass over its weights, the activations rounded once and one parallel region
// handing out the parts' groups in chunks.
void one_pass(const std::vector<Part>& parts, const at::Tensor& x, at::Tensor& y, int isa) {
  const int64_t T = x.size(0), K = x.size(1), ldy = y.size(1);
  const bool minimum = std::any_of(parts.begin(), parts.end(), has_minimum);
  const bool integer = isa >= kVnni || isa == kAvx2Int16;
  const int digits = integer ? activation_digits() : 2;
  // The minimum term: the block sums of x, or with one digit of the rounded activations (the
  // quantizers write those).
  const at::Tensor sx = minimum && digits == 2 ? block_sums(x) : at::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* sp = sx.defined() ? sx.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  int64_t groups = 0;
  for (const Part& p : parts) groups += p.w.G;
  // Two chunks per thread, so each streams long runs of the matrix (the prefetchers need them),
  // yet a thread that falls behind holds up half its share.
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, (groups + 2 * threads - 1) / (2 * threads));
  if (isa >= kVnni) {
    static thread_local Int8Activations xq;
    xq.quantize(xp, T, K, digits);
    // A copy: the pool's threads name their own (empty) thread_local, not this one.
    const Int8Digits view = xq.view;
    const TiledDigits tiled = xq.tiled;
    if (minimum && digits == 1) sp = view.rounded_sum;
    // Each type's start of the integer sums, once for all its parts and row groups.
    static thread_local std::vector<int32_t> starts[kNumKinds];
    const int32_t* start[kNumKinds] = {};
    bool done[kNumKinds] = {};
    for (const Part& p : parts) {
      const int k = static_cast<int>(p.w.kind);
      if (done[k]) continue;
      done[k] = true;
      offset_starts(p.w.kind, view, T, p.w.NB, starts[k]);
      start[k] = starts[k].empty() ? nullptr : starts[k].data();
    }
    parallel_chunks(groups, chunk, [&](int64_t begin, int64_t end) {
      for_part_groups(parts, begin, end, [&](const Part& p, int64_t g0, int64_t g1) {
        gemv_vnni(p.w, tiled, start[static_cast<int>(p.w.kind)], sp, T, yp + p.col0, ldy, g0, g1);
      });
    });
    return;
  }
  if (isa == kAvx2Int16) {
    static thread_local Int16Buffer xq;
    xq.quantize(xp, T, K, digits);
    const Int16Activations view = xq.view;  // a copy, as above
    if (minimum && digits == 1) sp = view.rounded_sum;
    parallel_chunks(groups, chunk, [&](int64_t begin, int64_t end) {
      for_part_groups(parts, begin, end, [&](const Part& p, int64_t g0, int64_t g1) {
        gemv_avx2_int16(p.w, view, sp, T, yp + p.col0, ldy, g0, g1);
      });
    });
    return;
  }
  parallel_chunks(groups, chunk, [&](int64_t begin, int64_t end) {
    for_part_groups(parts, begin, end, [&](const Part& p, int64_t g0, int64_t g1) {
      if (isa >= kAvx512) {
        gemv_avx512(p.w, xp, sp, T, yp + p.col0, ldy, g0, g1);
      } else {
        with_kind(p.w.kind, [&](auto kind) {
          gemv_avx2_kind<decltype(kind)::value>(p.w, xp, sp, T, yp + p.col0, ldy, g0, g1);
        });
      }
    });
  });
}

// Panels of groups, one at a time per thread: dequantize into float32 columns that stay in L2,
// then sgemm (single-threaded inside the pool) into the panel's columns of y.
void panels(const Part& part, const at::Tensor& x, at::Tensor& y) {
  const PackedMatrix& w = part.w;
  const int64_t K = w.K();
  const int64_t groups = std::clamp<int64_t>(65536 / K / kGroup, 1, 16);  // ~256 KiB of float32
  parallel_chunks(w.G, groups, [&](int64_t g0, int64_t g1) {
    static thread_local std::vector<float> scratch;  // kept: no allocation per panel
    const int64_t width = (g1 - g0) * kGroup;
    scratch.resize(K * width);
    dequantize_columns(w, g0, g1, scratch.data(), width);
    const int64_t cols = std::min(width, w.N - g0 * kGroup);
    const at::Tensor panel = at::from_blob(scratch.data(), {K, cols}, {width, 1}, x.options());
    at::Tensor out = y.narrow(1, part.col0 + g0 * kGroup, cols);
    at::mm_out(out, x, panel);
  });
}

// The parts AMX's tiles take, x rounded to bf16 once.
void amx(const std::vector<Part>& parts, const at::Tensor& x, at::Tensor& y) {
  const int64_t T = x.size(0), K = x.size(1);
  const int64_t padded = (T + 15) / 16 * 16;
  static thread_local std::vector<uint16_t> xb;
  xb.resize(padded * K);
  std::fill(xb.begin() + T * K, xb.end(), 0);
  to_bf16_rows(x.data_ptr<float>(), T, K, xb.data());
  for (const Part& p : parts) amx_linear(p.w, xb.data(), T, y.data_ptr<float>() + p.col0, y.size(1));
}

// A scalar row of any type, for the embedding lookup: the same float operations as
// dequantize_columns (scale * (u - offset) exact, + minimum rounding once).
template <Kind kKind>
void dequantize_row(const PackedMatrix& w, int64_t n, float* out) {
  constexpr BlockTraits T = traits(kKind);
  const int64_t r = n % kGroup;
  auto half = [](const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
  };
  for_records<kKind>(w, n / kGroup, [&](const uint8_t* rec, int64_t b, const uint8_t* header) {
    float m = 0.0f;
    if constexpr (T.min == MinForm::kF16) m = half(rec + T.mins_offset() + 2 * r);
    if constexpr (T.min == MinForm::kU8) m = -(half(header + 32 + 2 * r) * rec[T.mins_offset() + r]);
    for (int e = 0; e < kBlock; ++e) {
      int u;
      if constexpr (T.lo_bits == 4) {
        u = (rec[16 * (e / 2) + r] >> (4 * (e % 2))) & 0x0F;
      } else {
        u = static_cast<int8_t>(rec[kGroup * e + r]);
      }
      for (int k = 0; k < T.hi_planes; ++k) {
        uint64_t word;
        std::memcpy(&word, rec + T.lo_bytes() + 64 * k + 8 * (e / 4), 8);
        u |= static_cast<int>((word >> (4 * r + e % 4)) & 1) << (4 + k);
      }
      const int s = e / (kBlock / T.subs);
      const uint8_t* sc = rec + T.scales_offset() + s * T.scale_bytes();
      float d;
      if constexpr (T.scale == ScaleForm::kF16) {
        d = half(sc + 2 * r);
      } else if constexpr (T.scale == ScaleForm::kU8) {
        d = half(header + 2 * r) * static_cast<float>(sc[r]);
      } else {
        d = half(header + 2 * r) * static_cast<float>(static_cast<int8_t>(sc[r]));
      }
      out[b * kBlock + e] = std::fma(static_cast<float>(u - T.offset), d, m);
    }
  });
}

}  // namespace

void dequantize_columns(const PackedMatrix& w, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  with_kind(w.kind, [&](auto kind) {
    dequantize_columns_kind<decltype(kind)::value>(w, g0, g1, out, ldo);
  });
}

PackedMatrix packed_view(const char* op, const at::Tensor& blocks, int64_t kind, int64_t rows) {
  TORCH_CHECK(kind >= 0 && kind < kNumKinds, op, ": unknown matrix kind ", kind);
  const Kind k = static_cast<Kind>(kind);
  const BlockTraits& t = traits(k);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.is_contiguous() &&
                  blocks.size(2) == t.super_bytes() && blocks.device().is_cpu(),
              op, ": blocks must be contiguous uint8 [G, K/", kBlock * t.per_super(), ", ",
              t.super_bytes(), "], got ", blocks.scalar_type(), " ", blocks.sizes());
  const int64_t G = blocks.size(0);
  TORCH_CHECK(rows > (G - 1) * kGroup && rows <= G * kGroup, op, ": ", rows,
              " rows do not fill ", G, " groups of ", kGroup);
  return PackedMatrix{blocks.data_ptr<uint8_t>(), k, G, blocks.size(1) * t.per_super(), rows};
}

at::Tensor quant_linear(const at::Tensor& x_in, at::TensorList blocks, at::IntArrayRef kinds,
                        at::IntArrayRef rows, int64_t batched_min_tokens) {
  const char* op = "quant_linear";
  TORCH_CHECK(!blocks.empty() && blocks.size() == kinds.size() && blocks.size() == rows.size(), op,
              ": a projection needs one kind and one row count per part, got ", blocks.size(),
              " blocks, ", kinds.size(), " kinds, ", rows.size(), " row counts");
  TORCH_CHECK(x_in.dim() == 2, op, ": x must be 2-D [T, K], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), op,
              ": x must be a float32 CPU tensor, got ", x_in.scalar_type());
  std::vector<Part> parts;
  int64_t width = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const PackedMatrix w = packed_view(op, blocks[i], kinds[i], rows[i]);
    TORCH_CHECK(x_in.size(1) == w.K(), op, ": x has ", x_in.size(1),
                " features, the matrix takes ", w.K());
    parts.push_back({w, width});
    width += w.N;
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0);
  at::Tensor y = at::empty({T, width}, x.options());
  if (T == 0) return y;
  const int isa = active_isa();
  // Each part by its own type's crossover: the one pass for those below it (together), the
  // batched path for the rest.
  std::vector<Part> streamed, tiled;
  for (const Part& p : parts) {
    const int64_t limit = batched_min_tokens > 0 ? batched_min_tokens : auto_crossover(isa, p.w.kind);
    const bool batched = T >= limit && (isa < kAmx || amx_covers(p.w.kind));
    (batched ? tiled : streamed).push_back(p);
  }
  if (!streamed.empty()) one_pass(streamed, x, y, isa);
  if (tiled.empty()) return y;
  if (isa >= kAmx) {
    amx(tiled, x, y);
  } else {
    for (const Part& p : tiled) panels(p, x, y);
  }
  return y;
}

}  // namespace jitney_kernels

namespace {

at::Tensor quant_embedding(const at::Tensor& ids_in, const at::Tensor& blocks, int64_t kind,
                           int64_t rows) {
  using namespace jitney_kernels;
  const char* op = "quant_embedding";
  TORCH_CHECK(ids_in.scalar_type() == at::kLong || ids_in.scalar_type() == at::kInt, op,
              ": ids must be int64 or int32, got ", ids_in.scalar_type());
  const PackedMatrix w = packed_view(op, blocks, kind, rows);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), K = w.K();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, op, ": id ", ip[i], " out of range [0, ", rows, ")");
  }
  std::vector<int64_t> out_shape(ids.sizes().begin(), ids.sizes().end());
  out_shape.push_back(K);
  at::Tensor out = at::empty(out_shape, ids.options().dtype(at::kFloat));
  float* op_ = out.data_ptr<float>();
  with_kind(w.kind, [&](auto k) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dequantize_row<decltype(k)::value>(w, ip[i], op_ + i * K);
    });
  });
  return out;
}

}  // namespace

// The schemas are defined once, in Python (engine/kernels/ops.py), so the reference path and this
// one share them; this library only adds the CPU kernels.
TORCH_LIBRARY_IMPL(jitney, CPU, m) {
  m.impl("quant_linear", &jitney_kernels::quant_linear);
  m.impl("quant_embedding", &quant_embedding);
}
