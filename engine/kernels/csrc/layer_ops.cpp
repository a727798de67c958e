// The small per-layer ops of Jitney's CPU forward (engine/models/llama.py), float32 (the KV pool
// may hold bfloat16 or float16: rounded as written, widened as read), each one pass
// over its data. In eager torch each of them is 4-12 ops (a dispatch, an allocation and a pass
// over memory apiece); at one token per step that dispatch, not arithmetic, is what a layer
// spends outside its matrix products. The pure-torch definitions are engine/kernels/reference.py.
//
//   rms_norm(x, w, eps)                y = w * x / rms(x), rows of x [T, K]
//   add_rms_norm_(x, r, w, eps)        x += r in place, then y = rms_norm(x)
//   silu_mul(gu)                       gu [T, 2F] -> silu(gu[:, :F]) * gu[:, F:]
//   gelu_tanh_mul(gu)                  gu [T, 2F] -> gelu_tanh(gu[:, :F]) * gu[:, F:] (GeGLU)
//   rope_write_kv_(qkv, cos, sin, ...) Q and K rotated (after Qwen3's and Gemma's per-head
//                                      norms) over cos's width, K and V written to their cache
//                                      slots; returns [T, H + KV, D]
//   paged_decode_(q, kc, vc, ...)      one query token per sequence attending its own keys where
//                                      they lie in the paged pool (no gather, no mask)

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "attention.h"
#include "blocks.h"
#include "ops.h"
#include "vec_avx2.h"

namespace {

using jitney_kernels::dot;
using jitney_kernels::exp8;
using jitney_kernels::hsum;

inline float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// out = w * x * rsqrt(mean(x^2) + eps), n elements (out may be x).
inline void norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), iv);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), v));
  }
  for (; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_rows(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, op,
              ": x must be a float32 CPU tensor [T, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.stride(1) == 1, op, ": x's rows must be contiguous");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == x.size(1) &&
                  w.is_contiguous(),
              op, ": w must be contiguous float32 [", x.size(1), "], got ", w.sizes());
}

}  // namespace

namespace jitney_kernels {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows("rms_norm", x, w);
  const int64_t T = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({T, K}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    norm_row(xp + t * x.stride(0), w.data_ptr<float>(), static_cast<float>(eps), K, yp + t * K);
  }
  return y;
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps) {
  check_rows("add_rms_norm_", x, w);
  TORCH_CHECK(r.scalar_type() == at::kFloat && r.sizes() == x.sizes() && r.stride(1) == 1,
              "add_rms_norm_: r must be float32 shaped like x ", x.sizes(), ", got ", r.sizes());
  const int64_t T = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({T, K}, x.options());
  float* xp = x.data_ptr<float>();
  const float* rp = r.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* xr = xp + t * x.stride(0);
    const float* rr = rp + t * r.stride(0);
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) {
      _mm256_storeu_ps(xr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(rr + i)));
    }
    for (; i < K; ++i) xr[i] += rr[i];
    norm_row(xr, w.data_ptr<float>(), static_cast<float>(eps), K, yp + t * K);
  }
  return y;
}

// Both gates are g / (1 + exp(-z)) * u: SiLU with z = g, GELU-tanh with z = 2 sqrt(2/pi) (g +
// 0.044715 g^3) (0.5 (1 + tanh(z/2)) is the sigmoid of z). Eight at a time through exp8.
constexpr float kGeluZ1 = 1.5957691216057308f;   // 2 sqrt(2 / pi)
constexpr float kGeluZ3 = 0.0713548162726009f;   // 2 sqrt(2 / pi) 0.044715

template <bool kGelu>
at::Tensor gated_mul(const char* op, const at::Tensor& gu) {
  TORCH_CHECK(gu.device().is_cpu() && gu.scalar_type() == at::kFloat && gu.dim() == 2 &&
                  gu.size(1) % 2 == 0 && gu.stride(1) == 1,
              op, ": gu must be float32 [T, 2F] with contiguous rows, got ", gu.sizes());
  const int64_t T = gu.size(0), F = gu.size(1) / 2;
  at::Tensor y = at::empty({T, F}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256 z1 = _mm256_set1_ps(kGeluZ1), z3 = _mm256_set1_ps(kGeluZ3);
  at::parallel_for(0, T, std::max<int64_t>(1, 65536 / std::max<int64_t>(F, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * gu.stride(0);
      const float* u = g + F;
      float* out = yp + t * F;
      int64_t f = 0;
      for (; f + 8 <= F; f += 8) {
        const __m256 gv = _mm256_loadu_ps(g + f);
        __m256 z = gv;
        if constexpr (kGelu) z = _mm256_mul_ps(gv, _mm256_fmadd_ps(_mm256_mul_ps(gv, gv), z3, z1));
        const __m256 e = exp8(_mm256_sub_ps(zero, z));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + f, _mm256_mul_ps(s, _mm256_loadu_ps(u + f)));
      }
      for (; f < F; ++f) {
        const float z = kGelu ? g[f] * (kGeluZ1 + kGeluZ3 * g[f] * g[f]) : g[f];
        out[f] = g[f] / (1.0f + std::exp(-z)) * u[f];
      }
    }
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gu) { return gated_mul<false>("silu_mul", gu); }

at::Tensor gelu_tanh_mul(const at::Tensor& gu) { return gated_mul<true>("gelu_tanh_mul", gu); }

// x's first R elements rotated in place: x[i] cos[i] - x[i + R/2] sin[i] for the first half,
// x[i + R/2] cos + x[i] sin for the second (transformers' rotate_half convention; cos/sin hold
// both halves); the rest of the head as it is (Phi's partial rotation; R = 0: no RoPE).
static inline void rotate_head(float* x, const float* cos, const float* sin, int64_t R) {
  const int64_t half = R / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// The pool's element type for a cache tensor's dtype (refused: any other).
static KVType kv_type_of(const char* op, const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat:
      return KVType::kFloat32;
    case at::kBFloat16:
      return KVType::kBFloat16;
    case at::kHalf:
      return KVType::kFloat16;
    default:
      TORCH_CHECK(false, op, ": the caches must hold float32, bfloat16 or float16, not ",
                  cache.scalar_type());
  }
  return KVType::kFloat32;  // (unreachable)
}

// n floats into a cache slot: float32 as they are, bfloat16 and float16 rounded to nearest even
// (c10's conversions: what torch's .to(dtype) gives, so every path writes the same bits), float16
// held within its range as engine/kv_cache.py to_pool holds it (inf would make scores NaN).
static void store_row(const float* src, int64_t n, const at::Tensor& cache, int64_t offset) {
  if (cache.scalar_type() == at::kBFloat16) {
    c10::BFloat16* dst = cache.data_ptr<c10::BFloat16>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
  } else if (cache.scalar_type() == at::kHalf) {
    constexpr float kMax = 65504.0f;
    c10::Half* dst = cache.data_ptr<c10::Half>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(std::min(std::max(src[i], -kMax), kMax));
  } else {
    std::copy(src, src + n, cache.data_ptr<float>() + offset);
  }
}

at::Tensor rope_write_kv_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& slots, at::Tensor& key_slots, at::Tensor& value_slots,
                          int64_t num_heads, int64_t num_kv_heads,
                          const std::optional<at::Tensor>& q_norm,
                          const std::optional<at::Tensor>& k_norm, double eps) {
  const char* op = "rope_write_kv_";
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 &&
                  qkv.stride(1) == 1,
              op, ": qkv must be float32 [T, (H + 2 KV) D] with contiguous rows");
  const int64_t T = qkv.size(0), H = num_heads, KV = num_kv_heads;
  TORCH_CHECK(H > 0 && KV > 0 && qkv.size(1) % (H + 2 * KV) == 0, op, ": qkv's width ",
              qkv.size(1), " is not (", H, " + 2 * ", KV, ") heads");
  const int64_t D = qkv.size(1) / (H + 2 * KV);
  TORCH_CHECK(D % 2 == 0, op, ": odd head size ", D);
  const int64_t R = cos.dim() == 2 ? cos.size(1) : -1;  // the rotated width
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == R && R % 2 == 0 && R <= D && t->is_contiguous(),
                op, ": cos and sin must be contiguous float32 [", T, ", R], R even and <= ", D);
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T, op,
              ": slots must be int64 [", T, "]");
  for (const at::Tensor* t : {&key_slots, &value_slots}) {
    kv_type_of(op, *t);
    TORCH_CHECK(t->dim() == 3 && t->size(1) == KV && t->size(2) == D && t->stride(2) == 1 &&
                    t->stride(1) == D,
                op, ": the caches must be [slots, ", KV, ", ", D, "], got ", t->sizes());
  }
  TORCH_CHECK(key_slots.scalar_type() == value_slots.scalar_type(), op,
              ": K and V caches must hold one dtype");
  for (const auto* n : {&q_norm, &k_norm}) {
    TORCH_CHECK(!n->has_value() || ((*n)->scalar_type() == at::kFloat && (*n)->numel() == D &&
                                    (*n)->is_contiguous()),
                op, ": a per-head norm must be contiguous float32 [", D, "]");
  }
  const int64_t num_slots = key_slots.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, op, ": slot ", sp[t], " out of range [0, ",
                num_slots, ")");
  }
  at::Tensor qk = at::empty({T, H + KV, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  float* dst = qk.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = src + t * qkv.stride(0);
    const float* c = cos.data_ptr<float>() + t * R;
    const float* s = sin.data_ptr<float>() + t * R;
    for (int64_t h = 0; h < H + KV; ++h) {
      float* out = dst + (t * (H + KV) + h) * D;
      const float* w = h < H ? qn : kn;
      if (w != nullptr) {
        norm_row(row + h * D, w, e, D, out);
      } else {
        std::copy(row + h * D, row + (h + 1) * D, out);
      }
      rotate_head(out, c, s, R);
    }
    store_row(dst + (t * (H + KV) + H) * D, KV * D, key_slots, sp[t] * key_slots.stride(0));
    store_row(row + (H + KV) * D, KV * D, value_slots, sp[t] * value_slots.stride(0));
  }
  return qk;
}

constexpr int64_t kMaxGroup = 16;        // query heads per KV head

// paged_decode_'s (row, KV head) pairs as b * KV + kh, in the order its tasks run: row by row,
// except that a run of rows of one sequence (row b + 1 one position past row b over the same
// blocks) goes KV head by KV head, the run's rows in turn.
std::vector<int64_t> task_order(const int64_t* tables, int64_t table_stride, const int64_t* ctx,
                                int64_t B, int64_t KV, int64_t bs) {
  std::vector<int64_t> order;
  order.reserve(B * KV);
  for (int64_t first = 0; first < B;) {
    int64_t last = first + 1;  // the run is [first, last)
    while (last < B && ctx[last] == ctx[last - 1] + 1 &&
           std::equal(tables + last * table_stride, tables + last * table_stride + (ctx[last] + bs - 1) / bs,
                      tables + first * table_stride)) {
      ++last;
    }
    for (int64_t kh = 0; kh < KV; ++kh) {
      for (int64_t b = first; b < last; ++b) order.push_back(b * KV + kh);
    }
    first = last;
  }
  return order;
}

void paged_decode_(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                   int64_t window, at::Tensor& out) {
  const char* op = "paged_decode_";
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 &&
                  q.stride(2) == 1,
              op, ": q must be float32 [B, H, D] with contiguous heads");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 8 == 0 && D <= 8 * kMaxHeadVectors, op,
              ": the head size must be a multiple of 8 up to ", 8 * kMaxHeadVectors, ", got ", D);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.sizes() == q.sizes() && out.stride(2) == 1,
              op, ": out must be float32 shaped like q");
  for (const at::Tensor* t : {&key_cache, &value_cache}) {
    TORCH_CHECK(t->dim() == 4 && t->size(3) == D && t->stride(3) == 1 && t->stride(2) == D, op,
                ": the caches must be [blocks, block_size, KV, ", D, "]");
  }
  const KVType kv_type = kv_type_of(op, key_cache);
  TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              op, ": K and V caches must have one layout and dtype");
  const int64_t num_blocks = key_cache.size(0), bs = key_cache.size(1), KV = key_cache.size(2);
  TORCH_CHECK(H % KV == 0 && H / KV <= kMaxGroup, op, ": ", H, " query heads over ", KV,
              " KV heads (at most ", kMaxGroup, " per KV head)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == B && block_tables.stride(1) == 1,
              op, ": block_tables must be int64 [", B, ", W] with contiguous rows");
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.dim() == 1 && ctx_lens.size(0) == B &&
                  ctx_lens.is_contiguous(),
              op, ": ctx_lens must be contiguous int64 [", B, "]");
  const int64_t W = block_tables.size(1);
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* cp = ctx_lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(cp[b] >= 1 && cp[b] <= W * bs, op, ": context ", cp[b], " of row ", b,
                " does not fit its ", W, " blocks of ", bs);
    const int64_t* row = tp + b * block_tables.stride(0);
    for (int64_t j = 0; j < (cp[b] + bs - 1) / bs; ++j) {
      TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, op, ": block ", row[j], " out of range");
    }
    longest = std::max(longest, cp[b]);
  }
  const int64_t G = H / KV;
  const float* qp = q.data_ptr<float>();
  const char* kp = static_cast<const char*>(key_cache.data_ptr());
  const char* vp = static_cast<const char*>(value_cache.data_ptr());
  const int64_t head_bytes = D * key_cache.element_size();
  float* op_ = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // One task per (sequence, KV head): its G query heads share every key and value read. With
  // fewer such tasks than two per thread (one user: 1 x 3 KV heads on 2 threads), one per query
  // head instead, which balances the threads; the extra reads of K/V come from cache.
  const int64_t heads_per_task = B * KV >= 2 * at::get_num_threads() ? G : 1;
  const int64_t tasks_per_kv = G / heads_per_task;
  const bool wide = active_isa() >= kAvx512 && D % 16 == 0;  // attention_avx512.cpp
  const auto attend = wide ? attend_one_avx512 : attend_one_avx2;
  // Task order. Rows of different sequences: row by row, each row's KV heads in turn (a slot
  // holds every KV head's vector side by side, so the lines the prefetchers bring in beside one
  // head's are the next task's). A run of rows of one sequence (a verification: the fed token
  // and its drafts, one position apart) reads the same keys and values for every row: KV head
  // by KV head, its rows in turn, so each row after the first finds them in L2 (measured:
  // 8 rows at 1,600 positions took 35% less). The order changes no row's arithmetic.
  const std::vector<int64_t> order = task_order(tp, block_tables.stride(0), cp, B, KV, bs);
  const int64_t tasks = B * KV * tasks_per_kv;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads_per_task * ((longest + 15) / 16 * 16));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row_head = order[i / tasks_per_kv];  // b * KV + kh
      const int64_t b = row_head / KV, kh = row_head % KV;
      const int64_t h0 = kh * G + i % tasks_per_kv * heads_per_task;  // first query head
      const int64_t hi = cp[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, hi - window) : 0;
      attend(kv_type, qp + b * q.stride(0) + h0 * q.stride(1), q.stride(1), kp + kh * head_bytes,
             vp + kh * head_bytes,
             tp + b * block_tables.stride(0), bs, key_cache.stride(0), key_cache.stride(1), lo, hi,
             heads_per_task, D, sc, op_ + b * out.stride(0) + h0 * out.stride(1), out.stride(1),
             scores.data());
    }
  });
}

}  // namespace jitney_kernels

TORCH_LIBRARY_IMPL(jitney, CPU, m) {
  m.impl("rms_norm", &jitney_kernels::rms_norm);
  m.impl("add_rms_norm_", &jitney_kernels::add_rms_norm_);
  m.impl("silu_mul", &jitney_kernels::silu_mul);
  m.impl("gelu_tanh_mul", &jitney_kernels::gelu_tanh_mul);
  m.impl("rope_write_kv_", &jitney_kernels::rope_write_kv_);
  m.impl("paged_decode_", &jitney_kernels::paged_decode_);
}
