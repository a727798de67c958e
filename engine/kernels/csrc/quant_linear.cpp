// y = x @ W.T for weights kept in GGUF's Q4_1 / Q8_0 blocks, float32 activations kept exact.
//
// Packed layout (engine/kernels/packed_weights.py builds it from the GGUF blocks), N rows, K = 32*NB:
//   qs [N, NB*16] uint8 (Q4_1: ggml's nibbles as they are: byte j of a block holds element j in its
//                        low nibble and element j+16 in its high nibble)
//      [N, K]     int8  (Q8_0)
//   d  [N, NB] float32, m [N, NB] float32 (Q4_1 only), converted from the file's f16 exactly.
// Rows are whole blocks, so permuting rows never touches a block.
//
// Two paths, chosen per call by the number of tokens T:
//   fused  (T < panel_min_tokens): blocks are unpacked in registers and each unpacked block is used
//          for a tile of TT tokens (register tiling); x is read as float32, never quantized.
//          y[t,n] = sum_b d[n,b] * dot(q[n,b,:], x[t,b,:]) + sum_b m[n,b] * sum(x[t,b,:]).
//   panels (T >= panel_min_tokens): each thread dequantizes a panel of rows (sized to stay in L2)
//          into float32 scratch and multiplies it with MKL's sgemm (at::mm_out).
// Both split the output rows into chunks that torch's intra-op threads take one at a time.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "blocks.h"
#include "ops.h"

namespace {

using namespace jitney_kernels;

// y[t0:t0+TT, n0:n0+R] for rows n0.. of w and tokens t0.. of x. Each block is unpacked once per row
// and used for TT tokens; the R*TT accumulators stay in registers. Two ways to use a block:
//   kDequantFirst: w = d*q + m in registers (4 FMAs), then 4 FMAs per token; no m term after.
//   otherwise:     v = dot(q, x) per token (4 ops), acc += d*v (1 FMA); the m term is added at the
//                  end from sx [T, NB], the per-block sums of x. Fewer ops per block, more per token.
// Measured (one thread, the whole model's linears): the second is best for 1-2 tokens, the first
// from 3 tokens on; with tiles of 2 rows x 4 tokens, 4 tokens cost ~1.2x what 1 does.
template <class Fmt, int R, int TT, bool kDequantFirst, bool kPrefetch>
void tile(const Packed& w, int64_t n0, const float* x, const float* sx, int64_t t0, float* y) {
  const int64_t K = w.K, NB = w.NB;
  const int64_t row_bytes = NB * Fmt::kBlockBytes;
  __m256 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  const float* xt = x + t0 * K;
  for (int64_t b = 0; b < NB; ++b) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256 q[4];
      const uint8_t* block = w.qs + (n0 + r) * row_bytes + b * Fmt::kBlockBytes;
      if constexpr (kPrefetch) prefetch_ahead<Fmt>(w, n0 + r, b);
      Fmt::unpack(block, q);
      const __m256 dv = _mm256_broadcast_ss(w.d + (n0 + r) * NB + b);
      if constexpr (kDequantFirst) {
        if constexpr (Fmt::kHasMin) {
          const __m256 mv = _mm256_broadcast_ss(w.m + (n0 + r) * NB + b);
          for (int i = 0; i < 4; ++i) q[i] = _mm256_fmadd_ps(q[i], dv, mv);
        } else {
          for (int i = 0; i < 4; ++i) q[i] = _mm256_mul_ps(q[i], dv);
        }
      }
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const float* xb = xt + t * K + b * kBlock;
        if constexpr (kDequantFirst) {
          __m256 a = acc[r][t];
          a = _mm256_fmadd_ps(q[0], _mm256_loadu_ps(xb), a);
          a = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), a);
          a = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), a);
          acc[r][t] = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), a);
        } else {
          __m256 v = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
          v = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), v);
          v = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), v);
          v = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), v);
          acc[r][t] = _mm256_fmadd_ps(v, dv, acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TT; ++t) {
      float s = hsum(acc[r][t]);
      if constexpr (Fmt::kHasMin && !kDequantFirst) {
        s += dot(w.m + (n0 + r) * NB, sx + (t0 + t) * NB, NB);
      }
      y[(t0 + t) * w.N + n0 + r] = s;
    }
  }
}

template <class Fmt, int R, int TT, bool kDequantFirst>
inline void run_tile(bool prefetch, const Packed& w, int64_t n0, const float* x, const float* sx,
                     int64_t t0, float* y) {
  if (prefetch) {
    tile<Fmt, R, TT, kDequantFirst, true>(w, n0, x, sx, t0, y);
  } else {
    tile<Fmt, R, TT, kDequantFirst, false>(w, n0, x, sx, t0, y);
  }
}

// Rows n0..n0+R for all T tokens: tiles of 4 tokens, then one tile for the 1-3 left. Only the
// first tile prefetches (the later ones find the rows in L1).
template <class Fmt, int R>
void rows_all_tokens(const Packed& w, int64_t n0, const float* x, const float* sx, int64_t T,
                     float* y) {
  for (int64_t t0 = 0; t0 + 4 <= T; t0 += 4) run_tile<Fmt, R, 4, true>(t0 == 0, w, n0, x, sx, t0, y);
  const int64_t t0 = T / 4 * 4;
  switch (T - t0) {
    case 1: run_tile<Fmt, R, 1, false>(t0 == 0, w, n0, x, sx, t0, y); break;
    case 2: run_tile<Fmt, R, 2, false>(t0 == 0, w, n0, x, sx, t0, y); break;
    case 3: run_tile<Fmt, R, 3, true>(t0 == 0, w, n0, x, sx, t0, y); break;
    default: break;
  }
}

// Calls f(begin, end) for consecutive chunks of [0, n), handed out to torch's intra-op threads one
// at a time: a thread that falls behind (another process took its core) holds up one chunk, not
// a static half of the rows.
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

// Tiles of 2 rows; an odd last row runs alone.
template <class Fmt>
void fused_linear(const Packed& w, const float* x, const float* sx, int64_t T, float* y) {
  constexpr int R = 2;
  // Two chunks per thread, so each streams long runs of rows from memory (measured ~9% faster
  // over the whole model at one token than chunks of 64K multiply-adds, whose runs of rows are
  // too short for the prefetchers), yet a thread that falls behind holds up half its share; at
  // least 64K multiply-adds each, in whole cache lines of y's rows (16 floats) so two threads
  // never write the same line.
  const int64_t small = std::max<int64_t>(16, 65536 / (w.K * T) / 16 * 16);
  const int64_t chunk_rows = std::max(small, (w.N / (2 * at::get_num_threads()) + 15) / 16 * 16);
  parallel_chunks(w.N, chunk_rows, [&](int64_t begin, int64_t end) {
    int64_t n0 = begin;
    for (; n0 + R <= end; n0 += R) rows_all_tokens<Fmt, R>(w, n0, x, sx, T, y);
    if (n0 < end) rows_all_tokens<Fmt, 1>(w, n0, x, sx, T, y);
  });
}

// Panels of rows, one at a time per thread: dequantize into scratch that stays in L2, then sgemm
// (single-threaded inside the pool) into the panel's columns of y.
template <class Fmt>
void panel_linear(const Packed& w, const at::Tensor& x, at::Tensor& y) {
  // ~256 KiB of float32 scratch, in whole cache lines of y's rows (as in fused_linear).
  const int64_t rows = std::clamp<int64_t>((65536 / w.K) / 16 * 16, 16, 256);
  parallel_chunks(w.N, rows, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> scratch;  // kept: no allocation per panel
    scratch.resize(rows * w.K);
    const at::Tensor panel = at::from_blob(scratch.data(), {rows, w.K}, x.options());
    for (int64_t n0 = begin; n0 < end; n0 += rows) {
      const int64_t n = std::min(rows, end - n0);
      dequantize_rows<Fmt>(w, n0, n, scratch.data());
      at::Tensor out = y.narrow(1, n0, n);
      at::mm_out(out, x, panel.narrow(0, 0, n).t());
    }
  });
}

// Per-token block sums of x, [T, NB]: the m term's other factor.
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

void check_weights(const char* op, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                   int64_t block_bytes, at::ScalarType qs_dtype) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [T, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, op, ": K must be a multiple of 32, got ", K);
  TORCH_CHECK(qs.scalar_type() == qs_dtype, op, ": qs must be ", qs_dtype, ", got ", qs.scalar_type());
  TORCH_CHECK(qs.dim() == 2 && qs.size(1) == K / kBlock * block_bytes && qs.is_contiguous(), op,
              ": qs must be contiguous [N, ", K / kBlock * block_bytes, "], got ", qs.sizes());
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == qs.size(0) && d.size(1) == K / kBlock,
              op, ": d must be contiguous float32 [N, K/32]");
}

template <class Fmt>
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor* m, int64_t panel_min_tokens) {
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = qs.size(0);
  Packed w{reinterpret_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<float>(),
           m ? m->data_ptr<float>() : nullptr, N, K, K / kBlock};
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  if (T >= panel_min_tokens) {
    panel_linear<Fmt>(w, x, y);
  } else {
    // The m term's sums are only read by tiles of 1-2 tokens (see tile).
    const int64_t rest = T % 4;
    const bool needs_sums = Fmt::kHasMin && (rest == 1 || rest == 2);
    const at::Tensor sx = needs_sums ? block_sums(x) : at::Tensor();
    fused_linear<Fmt>(w, x.data_ptr<float>(), sx.defined() ? sx.data_ptr<float>() : nullptr, T,
                      y.data_ptr<float>());
  }
  return y;
}

}  // namespace

namespace jitney_kernels {

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& m, int64_t panel_min_tokens) {
  check_weights("q4_1_linear", x, qs, d, Q4_1::kBlockBytes, at::kByte);
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.sizes() == d.sizes(),
              "q4_1_linear: m must be contiguous float32 shaped like d");
  return quant_linear<Q4_1>(x, qs, d, &m, panel_min_tokens);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       int64_t panel_min_tokens) {
  check_weights("q8_0_linear", x, qs, d, Q8_0::kBlockBytes, at::kChar);
  return quant_linear<Q8_0>(x, qs, d, nullptr, panel_min_tokens);
}

}  // namespace jitney_kernels

namespace {

at::Tensor q8_0_embedding(const at::Tensor& ids_in, const at::Tensor& qs, const at::Tensor& d) {
  TORCH_CHECK(ids_in.scalar_type() == at::kLong || ids_in.scalar_type() == at::kInt,
              "q8_0_embedding: ids must be int64 or int32, got ", ids_in.scalar_type());
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.dim() == 2 && qs.is_contiguous(),
              "q8_0_embedding: qs must be contiguous int8 [N, K]");
  const int64_t N = qs.size(0), K = qs.size(1);
  TORCH_CHECK(K % kBlock == 0, "q8_0_embedding: K must be a multiple of 32, got ", K);
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == N && d.size(1) == K / kBlock,
              "q8_0_embedding: d must be contiguous float32 [N, K/32]");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  std::vector<int64_t> out_shape(ids.sizes().begin(), ids.sizes().end());
  out_shape.push_back(K);
  at::Tensor out = at::empty(out_shape, d.options());
  const int64_t n = ids.numel();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "q8_0_embedding: id ", ip[i], " out of range [0, ", N, ")");
  }
  Packed w{reinterpret_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<float>(), nullptr, N, K,
           K / kBlock};
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_rows<Q8_0>(w, ip[i], 1, op + i * K);
  });
  return out;
}

}  // namespace

// The schemas are defined once, in Python (engine/kernels/ops.py), so the reference path and this
// one share them; this library only adds the CPU kernels.
TORCH_LIBRARY_IMPL(jitney, CPU, m) {
  m.impl("q4_1_linear", &jitney_kernels::q4_1_linear);
  m.impl("q8_0_linear", &jitney_kernels::q8_0_linear);
  m.impl("q8_0_embedding", &q8_0_embedding);
}
