// paged_decode_'s inner loop for AVX-512 CPUs (layer_ops.cpp calls it where the CPU has AVX-512
// and the head size is a multiple of 16; the AVX2 loop beside it serves the rest). Compiled under
// a target pragma, like quant_avx512.cpp, so the library still loads on an AVX2-only CPU.
//
// One sequence's G query heads of one KV head over positions [lo, hi), reading keys and values
// where they lie in the paged pool. Scores: sixteen keys at a time, each key's products with a
// query head summed in a vector, the sixteen vectors then reduced into one vector of sixteen
// scores (a transposing tree of unpacks and lane shuffles: about 3 operations a score instead of
// a horizontal sum each). Each key and each value is loaded (and a bfloat16 or float16 pool
// widened to float32: a shift, or vcvtph2ps) once for up to four query heads of 64 floats (two
// of 128): SmolLM2's three share every load, where one head at a time loaded each key three
// times (verification rows at 1,000 positions: 0.77 ms a row against 1.05). Every score and
// output is summed as before, bit for bit.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")
#include <immintrin.h>

namespace jitney_kernels {
namespace {

// exp(x) for 16 floats: as layer_ops' exp8 (2^n e^r, Taylor to r^6, below -87 gives 0).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 small = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~small), p, _mm512_castsi512_ps(e));
}

// Sixteen of the pool's elements at p, as float32.
template <class Tag>
inline __m512 load16(const KVElem<Tag>* p) {
  if constexpr (std::is_same_v<Tag, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<Tag, BF16Tag>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Lane l of the result is the sum of the sixteen lanes of a[l].
inline __m512 reduce16(const __m512 a[16]) {
  __m512 b[8], c[4];
  for (int j = 0; j < 8; ++j) {  // per 128-bit lane: 2 partials of key 2j, 2 of key 2j+1
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]),
                         _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  }
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: one partial of each of keys 4j..4j+3
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * j]), _mm512_castps_pd(b[2 * j + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * j]), _mm512_castps_pd(b[2 * j + 1]));
    c[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // c[j]'s four 128-bit lanes each hold keys 4j..4j+3 over a quarter of the dimensions: sum the
  // quarters, key groups in order.
  const __m512 c01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                   _mm512_shuffle_f32x4(c[0], c[1], 0xDD));  // [c0 L0+L1, c0 L2+L3, c1 .., c1 ..]
  const __m512 c23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                   _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, 0x88), _mm512_shuffle_f32x4(c01, c23, 0xDD));
}

// f(std::integral_constant<int, h>{}) for h = 1..4 query heads served together.
template <class F>
inline void by_heads(int64_t h, const F& f) {
  if (h >= 4) {
    f(std::integral_constant<int, 4>{});
  } else if (h == 3) {
    f(std::integral_constant<int, 3>{});
  } else if (h == 2) {
    f(std::integral_constant<int, 2>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// H query heads' scores over positions [lo, hi) (scaled, before the softmax), into scores
// (H rows, `stride` apart): sixteen keys at a time, each key loaded once for all H heads; per
// head and key the products are summed as the one-head loop did (two chains, then a reduce16
// of sixteen keys), so every score is the same bit for bit.
template <int NV, class Tag, int H>
void score_keys(const float* q, int64_t q_head_stride, const KVElem<Tag>* kc, const int64_t* table,
                int64_t bs, int64_t block_stride, int64_t slot_stride, int64_t lo, int64_t hi,
                int64_t nv, float scale, float* scores, int64_t stride) {
  constexpr int kNV = NV > 0 ? NV : 16;
  __m512 qv[H][kNV];
  const __m512 s = _mm512_set1_ps(scale);
  for (int g = 0; g < H; ++g)
    for (int64_t i = 0; i < nv; ++i) qv[g][i] = _mm512_mul_ps(_mm512_loadu_ps(q + g * q_head_stride + 16 * i), s);
  Cursor at(table, bs, block_stride, slot_stride, lo);
  for (int64_t p0 = lo; p0 < hi; p0 += 16) {
    const int64_t m = std::min<int64_t>(16, hi - p0);
    __m512 a[H][16];
    for (int64_t k = 0; k < 16; ++k) {
      if (k >= m) {
        for (int g = 0; g < H; ++g) a[g][k] = _mm512_setzero_ps();
        continue;
      }
      const KVElem<Tag>* key = kc + at.offset();
      at.next();
      __m512 kv[kNV];
      for (int64_t i = 0; i < nv; ++i) kv[i] = load16<Tag>(key + 16 * i);
      for (int g = 0; g < H; ++g) {
        __m512 acc0 = _mm512_mul_ps(qv[g][0], kv[0]);
        __m512 acc1 = _mm512_setzero_ps();
        for (int64_t i = 1; i < nv; i += 2) {
          acc1 = _mm512_fmadd_ps(qv[g][i], kv[i], acc1);
          if (i + 1 < nv) acc0 = _mm512_fmadd_ps(qv[g][i + 1], kv[i + 1], acc0);
        }
        a[g][k] = _mm512_add_ps(acc0, acc1);
      }
    }
    for (int g = 0; g < H; ++g) _mm512_storeu_ps(scores + g * stride + (p0 - lo), reduce16(a[g]));
  }
}

// H heads' outputs over positions [lo, lo + n): out_g = sum_p w_g[p] v_p, each value vector
// loaded once for all H (w_g = w + g * w_stride, out_g = out + g * out_stride).
template <int NV, class Tag, int H>
void weigh_values(const KVElem<Tag>* vc, const int64_t* table, int64_t bs, int64_t block_stride,
                  int64_t slot_stride, int64_t lo, int64_t n, int64_t nv, const float* w,
                  int64_t w_stride, float* out, int64_t out_stride) {
  __m512 acc[H][NV > 0 ? NV : 16];
  for (int g = 0; g < H; ++g)
    for (int64_t i = 0; i < nv; ++i) acc[g][i] = _mm512_setzero_ps();
  Cursor at(table, bs, block_stride, slot_stride, lo);
  for (int64_t p = 0; p < n; ++p) {
    const KVElem<Tag>* val = vc + at.offset();
    at.next();
    __m512 a[H];
    for (int g = 0; g < H; ++g) a[g] = _mm512_set1_ps(w[g * w_stride + p]);
    for (int64_t i = 0; i < nv; ++i) {
      const __m512 v = load16<Tag>(val + 16 * i);
      for (int g = 0; g < H; ++g) acc[g][i] = _mm512_fmadd_ps(a[g], v, acc[g][i]);
    }
  }
  for (int g = 0; g < H; ++g)
    for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(out + g * out_stride + 16 * i, acc[g][i]);
}

template <int NV, class Tag>  // head size / 16 (0: any, read at run time); the pool's element
void attend(const float* q, int64_t q_head_stride, const KVElem<Tag>* kc, const KVElem<Tag>* vc,
            const int64_t* table, int64_t bs, int64_t block_stride, int64_t slot_stride, int64_t lo,
            int64_t hi, int64_t G, int64_t D, float scale, float* out, int64_t out_head_stride,
            float* scores) {
  const int64_t nv = NV > 0 ? NV : D / 16, n = hi - lo, stride = (n + 15) / 16 * 16;
  // Heads served by one read of the keys (and of the values): four of 64 floats, else two.
  constexpr int64_t kMaxHeads = NV > 0 && NV <= 4 ? 4 : 2;
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t h = std::min<int64_t>(kMaxHeads, G - g0);
    const float* qg = q + g0 * q_head_stride;
    float* sg = scores + g0 * stride;
    by_heads(h, [&](auto heads) {
      score_keys<NV, Tag, decltype(heads)::value>(qg, q_head_stride, kc, table, bs, block_stride,
                                                   slot_stride, lo, hi, nv, scale, sg, stride);
    });
    g0 += h;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * stride;
    // Softmax over the row (padding past n at -inf contributes nothing).
    for (int64_t j = n; j < stride; ++j) sg[j] = -std::numeric_limits<float>::infinity();
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < stride; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + j));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < stride; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), top));
      _mm512_storeu_ps(sg + j, e);
      total = _mm512_add_ps(total, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int64_t j = 0; j < stride; j += 16) _mm512_storeu_ps(sg + j, _mm512_mul_ps(_mm512_loadu_ps(sg + j), inv));
  }
  // out_g = sum_p w[g, p] v_p: each value vector loaded once for up to kMaxHeads heads, whose
  // accumulators stay in registers.
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t h = std::min<int64_t>(kMaxHeads, G - g0);
    const float* w = scores + g0 * stride;
    float* o = out + g0 * out_head_stride;
    by_heads(h, [&](auto heads) {
      weigh_values<NV, Tag, decltype(heads)::value>(vc, table, bs, block_stride, slot_stride, lo, n,
                                                     nv, w, stride, o, out_head_stride);
    });
    g0 += h;
  }
}

}  // namespace

void attend_one_avx512(KVType kv_type, const float* q, int64_t q_head_stride, const void* kc,
                       const void* vc, const int64_t* table, int64_t bs, int64_t block_stride,
                       int64_t slot_stride, int64_t lo, int64_t hi, int64_t G, int64_t D,
                       float scale, float* out, int64_t out_head_stride, float* scores) {
  by_kv_type(kv_type, [&](auto tag) {
    using Tag = decltype(tag);
    const auto* k = static_cast<const KVElem<Tag>*>(kc);
    const auto* v = static_cast<const KVElem<Tag>*>(vc);
    by_head_size<16>(D, [&](auto nv) {
      attend<decltype(nv)::value, Tag>(q, q_head_stride, k, v, table, bs, block_stride, slot_stride,
                                       lo, hi, G, D, scale, out, out_head_stride, scores);
    });
  });
}

}  // namespace jitney_kernels

#pragma GCC pop_options
