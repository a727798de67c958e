// paged_decode_'s inner loop for AVX2 (layer_ops.cpp calls it where the CPU has no AVX-512, or
// the head size is not a multiple of 16): one sequence's G query heads of one KV head over
// positions [lo, hi), reading keys and values where they lie in the paged pool.
//
// Scores: eight keys at a time, each key's products with a query head summed in one vector (the
// head's query stays in registers), the eight vectors then reduced into one vector of eight
// scores by a tree of horizontal adds and one lane swap: about one operation a score, where a
// horizontal sum per score costs six and its latency. Values: up to three heads at a time over
// part of the head (the accumulators in registers), so each value vector is loaded once for them. A head of 64 runs about six times faster than a loop that sums each score on its own
// and keeps its accumulators in memory (docs/performance.md). A bfloat16 or float16 pool is
// widened to float32 as it is loaded (a shift, or F16C's vcvtph2ps).

#include <algorithm>
#include <cstdint>
#include <limits>

#include "attention.h"
#include "vec_avx2.h"

namespace jitney_kernels {
namespace {

// Eight of the pool's elements at p, as float32.
template <class Tag>
inline __m256 load8(const KVElem<Tag>* p) {
  if constexpr (std::is_same_v<Tag, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<Tag, BF16Tag>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Lane l of the result is the sum of the eight lanes of a[l].
inline __m256 reduce8(const __m256 a[8]) {
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  // [k0, k1, k2, k3 over elements 0-3 | the same over elements 4-7], keys 4-7 alike
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// Row g of scores: softmax in place over its first n entries; entries n..stride-1 end at 0.
void softmax_row(float* sg, int64_t n, int64_t stride) {
  for (int64_t j = n; j < stride; ++j) sg[j] = -std::numeric_limits<float>::infinity();
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < stride; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + j));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 top = _mm256_set1_ps(_mm_cvtss_f32(m4));
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < stride; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), top));
    _mm256_storeu_ps(sg + j, e);
    total = _mm256_add_ps(total, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(total));
  for (int64_t j = 0; j < stride; j += 8) _mm256_storeu_ps(sg + j, _mm256_mul_ps(_mm256_loadu_ps(sg + j), inv));
}

// out[h] = sum_p w[h][p] v_p for HG heads (w rows `stride` apart), CV vectors of the head at a
// time: HG x CV accumulators stay in registers and each value vector is loaded once for all HG.
template <int HG, int CV, class Tag>
void weigh_values(const float* w, int64_t stride, const KVElem<Tag>* vc, const Cursor& start, int64_t n,
                  int64_t nv, float* out, int64_t out_head_stride) {
  for (int64_t c = 0; c < nv; c += CV) {
    const int64_t cn = std::min<int64_t>(CV, nv - c);
    __m256 acc[HG][CV];
    for (int h = 0; h < HG; ++h)
      for (int i = 0; i < CV; ++i) acc[h][i] = _mm256_setzero_ps();
    Cursor at = start;
    for (int64_t p = 0; p < n; ++p) {
      const KVElem<Tag>* val = vc + at.offset() + 8 * c;
      at.next();
      __m256 wp[HG];
      for (int h = 0; h < HG; ++h) wp[h] = _mm256_set1_ps(w[h * stride + p]);
#pragma GCC unroll 8
      for (int i = 0; i < CV; ++i) {  // unrolled, so the accumulators stay in registers
        if (i >= cn) break;
        const __m256 v = load8<Tag>(val + 8 * i);
        for (int h = 0; h < HG; ++h) acc[h][i] = _mm256_fmadd_ps(wp[h], v, acc[h][i]);
      }
    }
    for (int h = 0; h < HG; ++h)
      for (int i = 0; i < cn; ++i) _mm256_storeu_ps(out + h * out_head_stride + 8 * (c + i), acc[h][i]);
  }
}

template <int NV, class Tag>  // head size / 8 (0: any, read at run time); the pool's element
void attend(const float* q, int64_t q_head_stride, const KVElem<Tag>* kc, const KVElem<Tag>* vc,
            const int64_t* table, int64_t bs, int64_t block_stride, int64_t slot_stride, int64_t lo,
            int64_t hi, int64_t G, int64_t D, float scale, float* out, int64_t out_head_stride,
            float* scores) {
  const int64_t nv = NV > 0 ? NV : D / 8, n = hi - lo, stride = (n + 7) / 8 * 8;
  for (int64_t g = 0; g < G; ++g) {
    __m256 qv[NV > 0 ? NV : kMaxHeadVectors];
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < nv; ++i) qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + g * q_head_stride + 8 * i), s);
    float* sg = scores + g * stride;
    Cursor at(table, bs, block_stride, slot_stride, lo);
    for (int64_t p0 = lo; p0 < hi; p0 += 8) {
      const int64_t m = std::min<int64_t>(8, hi - p0);
      __m256 a[8];
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        if (k >= m) {
          a[k] = _mm256_setzero_ps();
          continue;
        }
        const KVElem<Tag>* key = kc + at.offset();
        at.next();
        __m256 acc0 = _mm256_mul_ps(qv[0], load8<Tag>(key));
        __m256 acc1 = _mm256_setzero_ps();
        for (int64_t i = 1; i < nv; i += 2) {
          acc1 = _mm256_fmadd_ps(qv[i], load8<Tag>(key + 8 * i), acc1);
          if (i + 1 < nv) acc0 = _mm256_fmadd_ps(qv[i + 1], load8<Tag>(key + 8 * i + 8), acc0);
        }
        a[k] = _mm256_add_ps(acc0, acc1);
      }
      _mm256_storeu_ps(sg + (p0 - lo), reduce8(a));
    }
    softmax_row(sg, n, stride);
  }
  // out_g = sum_p w[g, p] v_p: three or two heads and four vectors of the head at a time, or one
  // head's eight (a head alone: one user's step splits its query heads across the threads).
  for (int64_t g0 = 0; g0 < G;) {
    const int64_t left = G - g0;
    const float* w = scores + g0 * stride;
    float* o = out + g0 * out_head_stride;
    if (left == 1) {
      weigh_values<1, 8, Tag>(w, stride, vc, Cursor(table, bs, block_stride, slot_stride, lo), n, nv, o, out_head_stride);
      g0 += 1;
    } else if (left == 3) {
      weigh_values<3, 4, Tag>(w, stride, vc, Cursor(table, bs, block_stride, slot_stride, lo), n, nv, o, out_head_stride);
      g0 += 3;
    } else {
      weigh_values<2, 4, Tag>(w, stride, vc, Cursor(table, bs, block_stride, slot_stride, lo), n, nv, o, out_head_stride);
      g0 += 2;
    }
  }
}

}  // namespace

void attend_one_avx2(KVType kv_type, const float* q, int64_t q_head_stride, const void* kc,
                     const void* vc, const int64_t* table, int64_t bs, int64_t block_stride,
                     int64_t slot_stride, int64_t lo, int64_t hi, int64_t G, int64_t D, float scale,
                     float* out, int64_t out_head_stride, float* scores) {
  by_kv_type(kv_type, [&](auto tag) {
    using Tag = decltype(tag);
    const auto* k = static_cast<const KVElem<Tag>*>(kc);
    const auto* v = static_cast<const KVElem<Tag>*>(vc);
    by_head_size<8>(D, [&](auto nv) {
      attend<decltype(nv)::value, Tag>(q, q_head_stride, k, v, table, bs, block_stride, slot_stride,
                                       lo, hi, G, D, scale, out, out_head_stride, scores);
    });
  });
}

}  // namespace jitney_kernels
