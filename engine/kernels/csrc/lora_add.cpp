// jitney::lora_add_: one LoRA adapter's low-rank update added to a projection's output, for the
// rows of the step that run under it.
//
//   y[t, start_p : start_p + out_p] += b_p.T @ (x[t] @ a)[rank_start_p : rank_start_p + r_p]
//
// for each row t in `rows` and each part p (a fused projection's parts: Q, K, V or gate, up; each
// part's b is PEFT's B transposed, [r_p, out_p]; a is the parts' A stacked and transposed,
// [K, R], R padded with zero columns to a multiple of 16). a and the b's are int8 with a float32
// scale per rank (`scales`: a's [R], then each b's [r_p]), a quarter of an adapter's float32
// bytes, since a decode step reads every one of them beside the base's 4-bit blocks and the
// reading is what it costs; or float32, without scales. x and y float32.
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

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
inline float load1(const float* p) { return *p; }
inline float load1(const int8_t* p) { return static_cast<float>(*p); }

constexpr int64_t kChunk = 32;  // outputs a task of the B loop computes
// Up to this many multiply-adds one thread is faster than two: inside the one-call decode op a
// rank-16 SmolLM2 adapter's 120 updates of a row (18k-70k each) cost 0.8 ms a step on one
// thread, 1.3 ms on two (a parallel region's start and barriers cost more than the half).
constexpr int64_t kOneThreadWork = 262144;

constexpr int64_t kRankTile = 16;  // a's columns (padded to a multiple: lay_out's job)
constexpr int64_t kRowTile = 6;    // rows of x a task of the a loop takes at once (12 sums)
constexpr int64_t kWidenRows = 4;  // rows from which a chunk of b is widened once for all
constexpr int64_t kMaxRank = 1024;  // a part's rank (the engine's --max-lora-rank is checked)

// Q rows' low-rank activations for sixteen columns of a^T (float32 out,
// row stride `stride`; `scale`: the columns' int8 scales, or null): each input's sixteen
// weights loaded once, broadcast against Q rows.
template <typename W, int Q>
inline void a_tile(const W* col, const float* scale, int64_t R, const float* xs, int64_t K,
                   const int64_t* rows, float* out, int64_t stride) {
  const float* xr[Q];
  for (int q = 0; q < Q; ++q) xr[q] = xs + rows[q] * K;
  __m256 acc[Q][2];
  for (int q = 0; q < Q; ++q) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, col += R) {
    const __m256 a0 = load8(col), a1 = load8(col + 8);
    for (int q = 0; q < Q; ++q) {
      const __m256 xb = _mm256_broadcast_ss(xr[q] + k);
      acc[q][0] = _mm256_fmadd_ps(xb, a0, acc[q][0]);
      acc[q][1] = _mm256_fmadd_ps(xb, a1, acc[q][1]);
    }
  }
  if (scale != nullptr) {  // int8 columns: each column's scale, once per sum
    const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
    for (int q = 0; q < Q; ++q) {
      acc[q][0] = _mm256_mul_ps(acc[q][0], s0);
      acc[q][1] = _mm256_mul_ps(acc[q][1], s1);
    }
  }
  for (int q = 0; q < Q; ++q) {
    _mm256_storeu_ps(out + q * stride, acc[q][0]);
    _mm256_storeu_ps(out + q * stride + 8, acc[q][1]);
  }
}

// `count` (1 to kRowTile) rows' a_tile, the row count a compile-time constant.
template <typename W>
void a_rows(const W* col, const float* scale, int64_t R, const float* xs, int64_t K,
            const int64_t* rows, int64_t count, float* out) {
  switch (count) {
    case 6: return a_tile<W, 6>(col, scale, R, xs, K, rows, out, R);
    case 5: return a_tile<W, 5>(col, scale, R, xs, K, rows, out, R);
    case 4: return a_tile<W, 4>(col, scale, R, xs, K, rows, out, R);
    case 3: return a_tile<W, 3>(col, scale, R, xs, K, rows, out, R);
    case 2: return a_tile<W, 2>(col, scale, R, xs, K, rows, out, R);
    default: return a_tile<W, 1>(col, scale, R, xs, K, rows, out, R);
  }
}

// Q rows' outputs of one full chunk: each of b's widened weights (wb, [r, kChunk]) loaded once
// for all Q rows; lj[q]: row q's low-rank activations, scaled.
template <int Q>
inline void b_rows(const float* wb, int64_t r, const float* const* lj, float* const* yj) {
  constexpr int V = kChunk / 8;
  __m256 acc[Q][V];
  for (int q = 0; q < Q; ++q) {
    for (int v = 0; v < V; ++v) acc[q][v] = _mm256_loadu_ps(yj[q] + 8 * v);
  }
  for (int64_t k = 0; k < r; ++k) {
    for (int v = 0; v < V; ++v) {
      const __m256 w = _mm256_loadu_ps(wb + k * kChunk + 8 * v);
      for (int q = 0; q < Q; ++q) acc[q][v] = _mm256_fmadd_ps(_mm256_set1_ps(lj[q][k]), w, acc[q][v]);
    }
  }
  for (int q = 0; q < Q; ++q) {
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(yj[q] + 8 * v, acc[q][v]);
  }
}

// One adapter group's update of one projection, checked, with what the loops need of it.
struct Update {
  const int64_t* rows;
  int64_t n, K, R;
  const at::Tensor* a;
  at::TensorList b, scales;
  at::IntArrayRef starts;
  int64_t rank_tiles, row_tiles, chunks, max_rank, work;
  int64_t low = 0;  // where its low-rank activations start in the call's buffer

  int64_t tasks() const { return rank_tiles * row_tiles; }
};

Update checked(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
               const at::Tensor& a, at::TensorList b, at::TensorList scales,
               at::IntArrayRef starts) {
  const char* op = "lora_add_";
  TORCH_CHECK(a.dim() == 2 && a.size(0) == x.size(1) && a.size(1) % kRankTile == 0 &&
                  a.is_contiguous(),
              op, ": a must be contiguous [in, R], R a multiple of ", kRankTile);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, op, ": rows must be int64 [n]");
  TORCH_CHECK(starts.size() == 2 * b.size(), op, ": one (start, rank start) per part");
  const int64_t n = rows.numel();
  const int64_t* rs = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(rs[j] >= 0 && rs[j] < y.size(0), op, ": row ", rs[j], " outside [0, ", y.size(0),
                ")");
  }
  Update u{rs, n, a.size(0), a.size(1), &a, b, scales, starts, 0, 0, 0, 0, 0};
  for (size_t p = 0; p < b.size(); ++p) {
    const at::Tensor& bp = b[p];
    TORCH_CHECK(bp.dim() == 2 && bp.size(0) <= kMaxRank, op, ": a part's rank is at most ",
                kMaxRank);
    TORCH_CHECK(bp.is_contiguous() && bp.scalar_type() == a.scalar_type(), op,
                ": each b must be contiguous [r, out] in a's dtype");
    TORCH_CHECK(starts[2 * p] >= 0 && starts[2 * p] + bp.size(1) <= y.size(1) &&
                    starts[2 * p + 1] >= 0 && starts[2 * p + 1] + bp.size(0) <= a.size(1),
                op, ": part ", p, " lies outside y's columns or a's rank");
    u.chunks += (bp.size(1) + kChunk - 1) / kChunk;
    u.work += n * bp.numel();
    u.max_rank = std::max(u.max_rank, bp.size(0));
  }
  const bool int8 = a.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || a.scalar_type() == at::kFloat, op, ": a must be int8 or float32");
  TORCH_CHECK(scales.size() == (int8 ? 1 + b.size() : 0), op,
              ": int8 weights take a scale tensor for a and each b, float32 ones none");
  for (size_t i = 0; i < scales.size(); ++i) {
    const int64_t want = i == 0 ? a.size(1) : b[i - 1].size(0);
    TORCH_CHECK(scales[i].scalar_type() == at::kFloat && scales[i].is_contiguous() &&
                    scales[i].numel() == want,
                op, ": scale ", i, " must be float32 [", want, "]");
  }
  u.rank_tiles = u.R / kRankTile;
  u.row_tiles = (n + kRowTile - 1) / kRowTile;
  u.work += n * u.R * u.K;
  return u;
}

// The group and the index within it of a flat index over the groups' counts.
template <typename Count>
inline const Update& locate(const std::vector<Update>& us, int64_t& i, Count count) {
  size_t g = 0;
  while (i >= count(us[g])) i -= count(us[g++]);
  return us[g];
}

// Every group's update of one projection in one OpenMP region (a decode step makes four per
// layer, whatever the number of adapters in it): the low-rank activations x[t] @ a of every
// group first, then, after the loop's barrier, every group's outputs in chunks of kChunk.
// a is kept transposed, [in, R]: a task broadcasts each of six rows' inputs against sixteen
// neighbouring columns of a (twelve sums, no horizontal ones), so a's weights are read once per
// six rows; a chunk of b is widened to float32 once and used for every row.
template <typename W>
void update(at::Tensor& y, const at::Tensor& x, std::vector<Update>& us) {
  const int64_t N = y.size(1);
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  int64_t tasks = 0, chunks = 0, work = 0, max_rank = 0, low_size = 0;
  for (Update& u : us) {
    u.low = low_size;
    low_size += u.n * u.R;
    tasks += u.tasks();
    chunks += u.chunks;
    work += u.work;
    max_rank = std::max(max_rank, u.max_rank);
  }
  if (tasks == 0) return;
  const int threads = work < kOneThreadWork ? 1 : at::get_num_threads();
  std::vector<float> low(static_cast<size_t>(low_size));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> wide(static_cast<size_t>(max_rank * kChunk));
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      int64_t i = task;
      const Update& u = locate(us, i, [](const Update& v) { return v.tasks(); });
      const int64_t r0 = (i % u.rank_tiles) * kRankTile, j0 = (i / u.rank_tiles) * kRowTile;
      const float* scale = u.scales.empty() ? nullptr : u.scales[0].data_ptr<float>() + r0;
      a_rows<W>(u.a->data_ptr<W>() + r0, scale, u.R, xs, u.K, u.rows + j0,
                std::min(kRowTile, u.n - j0), low.data() + u.low + j0 * u.R + r0);
    }
    // Each part's b is kept transposed, [r, out]: a chunk of outputs takes one broadcast
    // low-rank activation (its int8 scale folded in) times neighbouring weights, no horizontal
    // sums. With several rows the chunk is widened to float32 once, for all of them.
#pragma omp for schedule(static)
    for (int64_t flat = 0; flat < chunks; ++flat) {
      int64_t c = flat;
      const Update& u = locate(us, c, [](const Update& v) { return v.chunks; });
      const at::TensorList b = u.b;
      const int64_t R = u.R, n = u.n;
      const int64_t* rows = u.rows;
      int64_t p = 0;
      while (c >= (b[p].size(1) + kChunk - 1) / kChunk) {
        c -= (b[p++].size(1) + kChunk - 1) / kChunk;
      }
      const int64_t r = b[p].size(0), out = b[p].size(1), o = c * kChunk;
      const int64_t width = std::min<int64_t>(kChunk, out - o);
      const int64_t start = u.starts[2 * p], rank_start = u.starts[2 * p + 1];
      const W* bt = b[p].data_ptr<W>() + o;
      const float* b_scale = u.scales.empty() ? nullptr : u.scales[1 + p].data_ptr<float>();
      const float* group_low = low.data() + u.low;
      const bool widened = n >= kWidenRows && width == kChunk;
      float* wb = wide.data();  // [r, kChunk]
      if (widened) {
        for (int64_t k = 0; k < r; ++k) {
          for (int64_t v = 0; v < kChunk; v += 8) {
            _mm256_storeu_ps(wb + k * kChunk + v, load8(bt + k * out + v));
          }
        }
      }
      // Row j's low-rank activations of this part, each rank's scale in.
      auto activations = [&](int64_t j, float* lj) {
        for (int64_t k = 0; k < r; ++k) {
          const float v = group_low[j * R + rank_start + k];
          lj[k] = b_scale ? v * b_scale[k] : v;
        }
      };
      float lj[2][kMaxRank];
      if (widened) {  // two rows a pass: each loaded weight serves both
        int64_t j = 0;
        for (; j + 2 <= n; j += 2) {
          activations(j, lj[0]);
          activations(j + 1, lj[1]);
          const float* l[2] = {lj[0], lj[1]};
          float* yj[2] = {ys + rows[j] * N + start + o, ys + rows[j + 1] * N + start + o};
          b_rows<2>(wb, r, l, yj);
        }
        if (j < n) {
          activations(j, lj[0]);
          const float* l[1] = {lj[0]};
          float* yj[1] = {ys + rows[j] * N + start + o};
          b_rows<1>(wb, r, l, yj);
        }
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        activations(j, lj[0]);
        float* yj = ys + rows[j] * N + start + o;
        if (width == kChunk) {
          __m256 acc[kChunk / 8];
          for (int64_t v = 0; v < kChunk / 8; ++v) acc[v] = _mm256_loadu_ps(yj + 8 * v);
          for (int64_t k = 0; k < r; ++k) {
            const __m256 lk = _mm256_set1_ps(lj[0][k]);
            for (int64_t v = 0; v < kChunk / 8; ++v) {
              acc[v] = _mm256_fmadd_ps(lk, load8(bt + k * out + 8 * v), acc[v]);
            }
          }
          for (int64_t v = 0; v < kChunk / 8; ++v) _mm256_storeu_ps(yj + 8 * v, acc[v]);
        } else {
          for (int64_t q = 0; q < width; ++q) {
            float acc = 0.f;
            for (int64_t k = 0; k < r; ++k) acc += lj[0][k] * load1(bt + k * out + q);
            yj[q] += acc;
          }
        }
      }
    }
  }
}

void check_y_x(const at::Tensor& y, const at::Tensor& x) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0),
              "lora_add_: y and x must be [T, out] and [T, in]");
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  y.is_contiguous() && x.is_contiguous(),
              "lora_add_: y and x must be contiguous float32");
}

void run(at::Tensor& y, const at::Tensor& x, std::vector<Update>& us) {
  if (us.empty()) return;
  const bool int8 = us[0].a->scalar_type() == at::kChar;
  for (const Update& u : us) {
    TORCH_CHECK((u.a->scalar_type() == at::kChar) == int8,
                "lora_add_: one call's adapters share one weight dtype");
  }
  if (int8) {
    update<int8_t>(y, x, us);
  } else {
    update<float>(y, x, us);
  }
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& a,
               at::TensorList b, at::TensorList scales, at::IntArrayRef starts) {
  check_y_x(y, x);
  std::vector<Update> us{checked(y, x, rows, a, b, scales, starts)};
  run(y, x, us);
}

void lora_add_groups(at::Tensor& y, const at::Tensor& x, const std::vector<LoraSlot>& slots) {
  check_y_x(y, x);
  std::vector<Update> us;
  for (const LoraSlot& s : slots) {
    if (s.tensors[0].numel() == 0) continue;  // an unused slot
    const int64_t parts = s.ints[0];
    TORCH_CHECK(parts >= 1 && parts <= kLoraMaxParts, "lora slot: ", parts, " parts");
    const int64_t scales = s.tensors[1 + kLoraMaxParts].numel() > 0 ? 1 + parts : 0;
    us.push_back(checked(y, x, *s.rows, s.tensors[0], at::TensorList(s.tensors + 1, parts),
                         at::TensorList(s.tensors + 1 + kLoraMaxParts, scales),
                         at::IntArrayRef(s.ints + 1, 2 * parts)));
  }
  run(y, x, us);
}

void lora_add_slots_(at::Tensor& y, const at::Tensor& x, at::TensorList rows, at::TensorList lora,
                     at::IntArrayRef lora_ints) {
  const int64_t G = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(lora.size()) == G * kLoraSlotTensors &&
                  static_cast<int64_t>(lora_ints.size()) == G * kLoraSlotInts,
              "lora_add_slots_: ", kLoraSlotTensors, " tensors and ", kLoraSlotInts,
              " ints per group");
  std::vector<LoraSlot> slots;
  for (int64_t g = 0; g < G; ++g) {
    slots.push_back({&rows[g], lora.data() + g * kLoraSlotTensors,
                     lora_ints.data() + g * kLoraSlotInts});
  }
  lora_add_groups(y, x, slots);
}

}  // namespace jitney_kernels

TORCH_LIBRARY_IMPL(jitney, CPU, m) {
  m.impl("lora_add_", &jitney_kernels::lora_add_);
  m.impl("lora_add_slots_", &jitney_kernels::lora_add_slots_);
}
