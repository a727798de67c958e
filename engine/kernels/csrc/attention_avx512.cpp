// paged_decode_'s inner loop for AVX-512 CPUs (layer_ops.cpp calls it where the CPU has AVX-512
// and the head size is a multiple of 16; the AVX2 loop beside it serves the rest). Compiled under
// a target pragma, like quant_avx512.cpp, so the library still loads on an AVX2-only CPU.
//
// One sequence's G query heads of one KV head over positions [lo, hi), reading keys and values
// where they lie in the paged pool. Scores: sixteen keys at a time, each key's products with a
// query head summed in a vector, the sixteen vectors then reduced into one vector of sixteen
// scores (a transposing tree of unpacks and lane shuffles: about 3 operations a score instead of
// a horizontal sum each). Values: each value vector loaded once for all G heads. A bfloat16 or
// float16 pool is widened to float32 as it is loaded (a shift, or vcvtph2ps).

#include <algorithm>
#include <cstdint>
#include <limits>

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

template <int NV, class Tag>  // head size / 16 (0: any, read at run time); the pool's element
void attend(const float* q, int64_t q_head_stride, const KVElem<Tag>* kc, const KVElem<Tag>* vc,
            const int64_t* table, int64_t bs, int64_t block_stride, int64_t slot_stride, int64_t lo,
            int64_t hi, int64_t G, int64_t D, float scale, float* out, int64_t out_head_stride,
            float* scores) {
  const int64_t nv = NV > 0 ? NV : D / 16, n = hi - lo, stride = (n + 15) / 16 * 16;
  for (int64_t g = 0; g < G; ++g) {
    __m512 qv[16];
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < nv; ++i) qv[i] = _mm512_mul_ps(_mm512_loadu_ps(q + g * q_head_stride + 16 * i), s);
    float* sg = scores + g * stride;
    Cursor at(table, bs, block_stride, slot_stride, lo);
    for (int64_t p0 = lo; p0 < hi; p0 += 16) {
      const int64_t m = std::min<int64_t>(16, hi - p0);
      __m512 a[16];
      for (int64_t k = 0; k < 16; ++k) {
        if (k >= m) {
          a[k] = _mm512_setzero_ps();
          continue;
        }
        const KVElem<Tag>* key = kc + at.offset();
        at.next();
        __m512 acc0 = _mm512_mul_ps(qv[0], load16<Tag>(key));
        __m512 acc1 = _mm512_setzero_ps();
        for (int64_t i = 1; i < nv; i += 2) {
          acc1 = _mm512_fmadd_ps(qv[i], load16<Tag>(key + 16 * i), acc1);
          if (i + 1 < nv) acc0 = _mm512_fmadd_ps(qv[i + 1], load16<Tag>(key + 16 * i + 16), acc0);
        }
        a[k] = _mm512_add_ps(acc0, acc1);
      }
      _mm512_storeu_ps(sg + (p0 - lo), reduce16(a));
    }
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
  // out_g = sum_p w[g, p] v_p: each value vector loaded once for two heads at a time (their
  // 2 x nv accumulators stay in registers).
  for (int64_t g0 = 0; g0 < G; g0 += 2) {
    const int64_t gn = std::min<int64_t>(2, G - g0);
    __m512 acc[2][16];
    for (int64_t g = 0; g < 2; ++g)
      for (int64_t i = 0; i < nv; ++i) acc[g][i] = _mm512_setzero_ps();
    const float* w0 = scores + g0 * stride;
    const float* w1 = gn > 1 ? w0 + stride : w0;
    Cursor at(table, bs, block_stride, slot_stride, lo);
    for (int64_t p = 0; p < n; ++p) {
      const KVElem<Tag>* val = vc + at.offset();
      at.next();
      const __m512 a = _mm512_set1_ps(w0[p]), b = _mm512_set1_ps(w1[p]);
      for (int64_t i = 0; i < nv; ++i) {
        const __m512 v = load16<Tag>(val + 16 * i);
        acc[0][i] = _mm512_fmadd_ps(a, v, acc[0][i]);
        acc[1][i] = _mm512_fmadd_ps(b, v, acc[1][i]);
      }
    }
    for (int64_t g = 0; g < gn; ++g)
      for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(out + (g0 + g) * out_head_stride + 16 * i, acc[g][i]);
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
