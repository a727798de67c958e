// jitney::lora_add_: one LoRA adapter's low-rank update added to a projection's output, for the
// rows of the step that run under it.
//
//   y[t, start_p : start_p + out_p] += b_p.T @ (a @ x[t])[rank_start_p : rank_start_p + r_p]
//
// for each row t in `rows` and each part p (a fused projection's parts: Q, K, V or gate, up; each
// part's b is PEFT's B transposed, [r_p, out_p]). a [R, K] and the b's are float16 (half an adapter's float32 bytes:
// a decode step reads them all, beside the base's 4-bit blocks) or float32; x and y float32.
// The quantized forward calls it per projection (engine/lora/), and llama_decode_layers_ after
// each of its matrices, without Python between.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"

namespace jitney_kernels {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float load1(const float* p) { return *p; }
inline float load1(const at::Half* p) { return static_cast<float>(*p); }

// w (a weight row, float16 or float32) . v (float32), n elements.
template <typename W>
float dot(const W* w, const float* v, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(v + i), acc0);
    acc1 = _mm256_fmadd_ps(load8(w + i + 8), _mm256_loadu_ps(v + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(v + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += load1(w + i) * v[i];
  return s;
}

constexpr int64_t kChunk = 32;  // outputs a task of the B loop computes
// Up to this many multiply-adds one thread is faster than two. Past it two are (measured: a
// decode row's four updates of a rank-16 SmolLM2 adapter, 18k-70k each, run 1.4x faster on two
// threads than on one; the updates are bound by reading the weights).
constexpr int64_t kOneThreadWork = 16384;

// One OpenMP region per call (a decode step makes four per layer): the low-rank activations
// a @ x[t] first, then, after the loop's barrier, every part's outputs as one flat range.
template <typename W>
void update(at::Tensor& y, const at::Tensor& x, const int64_t* rows, int64_t n,
            const at::Tensor& a, at::TensorList b, at::IntArrayRef starts) {
  const int64_t R = a.size(0), K = a.size(1), N = y.size(1);
  const int64_t P = static_cast<int64_t>(b.size());
  const W* aw = a.data_ptr<W>();
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  std::vector<float> low(static_cast<size_t>(n * R));
  int64_t chunks = 0, work = n * R * K;
  for (int64_t p = 0; p < P; ++p) {
    chunks += (b[p].size(1) + kChunk - 1) / kChunk;
    work += n * b[p].numel();
  }
  const int threads = work < kOneThreadWork ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n * R; ++i) {
      low[i] = dot(aw + (i % R) * K, xs + rows[i / R] * K, K);
    }
    // Each part's b is kept transposed, [r, out]: a chunk of outputs takes one broadcast
    // low-rank activation times neighbouring weights (no horizontal sums), 32 at a time (a
    // cache line of float16 weights per rank).
#pragma omp for schedule(static)
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      int64_t p = 0, c = chunk;
      while (c >= (b[p].size(1) + kChunk - 1) / kChunk) {
        c -= (b[p++].size(1) + kChunk - 1) / kChunk;
      }
      const int64_t r = b[p].size(0), out = b[p].size(1), o = c * kChunk;
      const int64_t width = std::min<int64_t>(kChunk, out - o);
      const int64_t start = starts[2 * p], rank_start = starts[2 * p + 1];
      const W* bt = b[p].data_ptr<W>() + o;
      for (int64_t j = 0; j < n; ++j) {
        const float* lj = low.data() + j * R + rank_start;
        float* yj = ys + rows[j] * N + start + o;
        if (width == kChunk) {
          __m256 acc[kChunk / 8];
          for (int64_t v = 0; v < kChunk / 8; ++v) acc[v] = _mm256_loadu_ps(yj + 8 * v);
          for (int64_t k = 0; k < r; ++k) {
            const __m256 lk = _mm256_set1_ps(lj[k]);
            for (int64_t v = 0; v < kChunk / 8; ++v) {
              acc[v] = _mm256_fmadd_ps(lk, load8(bt + k * out + 8 * v), acc[v]);
            }
          }
          for (int64_t v = 0; v < kChunk / 8; ++v) _mm256_storeu_ps(yj + 8 * v, acc[v]);
        } else {
          for (int64_t q = 0; q < width; ++q) {
            float acc = 0.f;
            for (int64_t k = 0; k < r; ++k) acc += lj[k] * load1(bt + k * out + q);
            yj[q] += acc;
          }
        }
      }
    }
  }
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& a,
               at::TensorList b, at::IntArrayRef starts) {
  const char* op = "lora_add_";
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), op,
              ": y and x must be [T, out] and [T, in]");
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  y.is_contiguous() && x.is_contiguous(),
              op, ": y and x must be contiguous float32");
  TORCH_CHECK(a.dim() == 2 && a.size(1) == x.size(1) && a.is_contiguous(), op,
              ": a must be contiguous [R, in]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, op, ": rows must be int64 [n]");
  TORCH_CHECK(starts.size() == 2 * b.size(), op, ": one (start, rank start) per part");
  const int64_t n = rows.numel();
  const int64_t* rs = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(rs[j] >= 0 && rs[j] < y.size(0), op, ": row ", rs[j], " outside [0, ", y.size(0),
                ")");
  }
  for (size_t p = 0; p < b.size(); ++p) {
    const at::Tensor& bp = b[p];
    TORCH_CHECK(bp.dim() == 2 && bp.is_contiguous() && bp.scalar_type() == a.scalar_type(), op,
                ": each b must be contiguous [r, out] in a's dtype");
    TORCH_CHECK(starts[2 * p] >= 0 && starts[2 * p] + bp.size(1) <= y.size(1) &&
                    starts[2 * p + 1] >= 0 && starts[2 * p + 1] + bp.size(0) <= a.size(0),
                op, ": part ", p, " lies outside y's columns or a's rank");
  }
  if (a.scalar_type() == at::kHalf) {
    update<at::Half>(y, x, rs, n, a, b, starts);
  } else {
    TORCH_CHECK(a.scalar_type() == at::kFloat, op, ": a must be float16 or float32");
    update<float>(y, x, rs, n, a, b, starts);
  }
}

}  // namespace jitney_kernels

TORCH_LIBRARY_IMPL(jitney, CPU, m) { m.impl("lora_add_", &jitney_kernels::lora_add_); }
