// jitney::lora_add_: LoRA adapters' low-rank updates added to a projection's output, each
// adapter's for the rows of the step that run under it.
//
//   y[t, start_p : start_p + out_p] += (x[t] @ A^T)[rank_start_p : + r_p] @ B_p^T
//
// for each row t in `rows` and each part p (a fused projection's parts: Q, K, V or gate, up).
// Weights are int8 with a float32 scale per rank (`scales`: a's [R], then each b's [r_p]), a
// quarter of float32's bytes, each matrix one sequential stream in the order the loops read it
// (a decode step's updates find their weights out of cache: a stream is what the hardware
// prefetcher follows), four neighbouring weights of a row in each 32-bit lane:
//   a    [R / 16, K / 4, 64]: per tile of 16 ranks, per four inputs, 16 lanes (a[t, g, 4 l + i]
//        = A[16 t + l, 4 g + i]); the parts' A stacked, each part's ranks padded with zeros to
//        a multiple of 4 (so every rank start is one), R to a multiple of 16, K to one of 32;
//   b_p  [ceil(out_p / 32), r_p / 4, 128]: per chunk of 32 outputs, per four ranks, 32 lanes.
// An adapter's matrices lie in one int8 buffer in the order a decode step reads them, their
// scales in one float32 buffer, and a record per update says where (ops.h: a pack);
// engine/lora/adapter_set.py's KernelPack lays them out, kernels/reference.py reads the same.
//
// a's product is float32 multiply-adds (a projection has 16-64 ranks: rounding each row's x to
// integer digits would cost as much as the products). b's, on VNNI CPUs, is integer dot
// products: each row's low-rank activations (B's scales in) become two int8 digits per value
// (quant_vnni.cpp's quantize_activations: about 15 bits), so a 64-byte load of weights serves
// four products a lane for every row, and a row's integer sums are exact. Either way a row's
// result does not depend on the other rows of the step. Elsewhere (AVX2) float32 throughout,
// each weight byte picked out of its lane by two shifts. The quantized forward calls it per
// projection (engine/lora/), and llama_decode_layers_ after each of its matrices.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "blocks.h"
#include "ops.h"

namespace jitney_kernels {
namespace {

constexpr int64_t kRankTile = 16;  // a's ranks a task of the a loop computes (one 16-lane vector)
constexpr int64_t kChunk = 32;     // outputs a task of the b loop computes
constexpr int64_t kRowTile = 4;    // rows a task takes at once: each weight load serves them all
constexpr int64_t kMaxRank = 1024;  // a part's rank (the engine's --max-lora-rank is checked)
// Up to this many multiply-adds one thread is faster than two: inside the one-call decode op a
// rank-16 SmolLM2 adapter's 120 updates of a row (18k-70k each) cost less on one thread than a
// parallel region's start and barriers on two (docs/notes/lora.md).
constexpr int64_t kOneThreadWork = 262144;

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// One adapter group's update of one projection, checked, with what the loops need of it.
struct Update {
  const int64_t* rows;
  int64_t n, K, R;
  const int8_t* a;
  const float* a_scale;
  int64_t parts;
  const int8_t* b[kLoraMaxParts];
  const float* b_scale[kLoraMaxParts];
  int64_t r[kLoraMaxParts], out[kLoraMaxParts], start[kLoraMaxParts], rank_start[kLoraMaxParts];
  int64_t rank_tiles, row_tiles, chunks, work;
  int64_t low = 0;  // where its rows' low-rank activations start in the call's buffer
  int64_t tasks() const { return rank_tiles * row_tiles; }
  int64_t part_chunks(int64_t p) const { return (out[p] + kChunk - 1) / kChunk; }
};

// A group's record of its update (its pack checked: a pack is data from Python, and a wrong
// one must fail here, not read past its buffers).
const int64_t* record(const LoraGroup& group) {
  const at::Tensor& weights = group.pack[0];
  const at::Tensor& scales = group.pack[1];
  const at::Tensor& records = group.pack[2];
  TORCH_CHECK(weights.scalar_type() == at::kChar && weights.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  records.scalar_type() == at::kLong && records.is_contiguous() &&
                  records.dim() == 2 && records.size(1) == kLoraRecordInts,
              "lora_add_: a pack is int8 weights, float32 scales and int64 records [n, ",
              kLoraRecordInts, "]");
  TORCH_CHECK(group.entry >= 0 && group.entry < records.size(0), "lora_add_: entry ",
              group.entry, " outside the pack's ", records.size(0), " records");
  return records.data_ptr<int64_t>() + group.entry * kLoraRecordInts;
}

// One group's update, its record `rec` checked against the pack's buffers and the call's y
// and x: every offset and size.
Update from_record(const at::Tensor& y, const at::Tensor& x, const LoraGroup& group,
                   const int64_t* rec) {
  const char* op = "lora_add_";
  const at::Tensor& rows = *group.rows;
  const at::Tensor& weights = group.pack[0];
  const at::Tensor& scales = group.pack[1];
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, op, ": rows must be int64 [n]");
  const int64_t W = weights.numel(), S = scales.numel();
  const int64_t parts = rec[0], K = rec[1], R = rec[2], a_at = rec[3], a_scale_at = rec[4];
  TORCH_CHECK(parts >= 1 && parts <= kLoraMaxParts, op, ": a record of ", parts, " parts");
  TORCH_CHECK(K == round_up(x.size(1), kBlock) && R > 0 && R % kRankTile == 0 && a_at >= 0 &&
                  a_at + R * K <= W && a_scale_at >= 0 && a_scale_at + R <= S,
              op, ": entry ", group.entry, "'s A does not fit its pack or x's ", x.size(1),
              " inputs");
  const int64_t n = rows.numel();
  const int64_t* rs = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(rs[j] >= 0 && rs[j] < y.size(0), op, ": row ", rs[j], " outside [0, ", y.size(0),
                ")");
  }
  const int8_t* w = weights.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  Update u{rs, n, K, R, w + a_at, sc + a_scale_at, parts};
  u.chunks = 0;
  u.work = n * R * K;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t* part = rec + 5 + 6 * p;
    const int64_t b_at = part[0], b_scale_at = part[1], r = part[2];
    u.r[p] = r;
    u.start[p] = part[3];
    u.rank_start[p] = part[4];
    u.out[p] = part[5];
    TORCH_CHECK(r > 0 && r % 4 == 0 && r <= kMaxRank && u.out[p] > 0 && b_at >= 0 &&
                    b_at + u.part_chunks(p) * r * kChunk <= W && b_scale_at >= 0 &&
                    b_scale_at + r <= S,
                op, ": entry ", group.entry, "'s part ", p, " does not fit its pack");
    TORCH_CHECK(u.start[p] >= 0 && u.start[p] + u.out[p] <= y.size(1) && u.rank_start[p] >= 0 &&
                    u.rank_start[p] % 4 == 0 && u.rank_start[p] + r <= R,
                op, ": part ", p, " lies outside y's columns or a's ranks");
    u.b[p] = w + b_at;
    u.b_scale[p] = sc + b_scale_at;
    u.chunks += u.part_chunks(p);
    u.work += n * r * u.out[p];
  }
  u.rank_tiles = R / kRankTile;
  u.row_tiles = (n + kRowTile - 1) / kRowTile;
  return u;
}

// The group and the index within it of a flat index over the groups' counts.
template <typename Count>
inline const Update& locate(const std::vector<Update>& us, int64_t& i, Count count) {
  size_t g = 0;
  while (i >= count(us[g])) i -= count(us[g++]);
  return us[g];
}

// What both forms share: the groups' low-rank activations ([n, R] per group, `low`), their
// rows of x (zero-padded to K where x is narrower), and the counts of the loops' tasks.
struct Step {
  std::vector<Update>& us;
  const at::Tensor& x;
  std::vector<float>& low;
  std::vector<float>& padded;  // [rows, K], used where x's width is not K
  std::vector<int64_t> first;  // per group, its first row in the flat order
  int64_t rows = 0, tasks = 0, chunks = 0, work = 0;

  Step(std::vector<Update>& updates, const at::Tensor& in, std::vector<float>& low_buffer,
       std::vector<float>& pad_buffer)
      : us(updates), x(in), low(low_buffer), padded(pad_buffer) {
    int64_t low_size = 0;
    for (Update& u : us) {
      u.low = low_size;
      low_size += u.n * u.R;
      first.push_back(rows);
      rows += u.n;
      tasks += u.tasks();
      chunks += u.chunks;
      work += u.work;
    }
    if (static_cast<int64_t>(low.size()) < low_size) low.resize(static_cast<size_t>(low_size));
    const int64_t K = us.empty() ? 0 : us[0].K;
    if (x.size(1) != K && static_cast<int64_t>(padded.size()) < rows * K) {
      padded.resize(static_cast<size_t>(rows * K));
    }
  }

  // The group and the row within it of a flat row index.
  std::pair<int64_t, int64_t> row(int64_t flat) const {
    const int64_t g = &locate(us, flat, [](const Update& v) { return v.n; }) - us.data();
    return {g, flat};
  }

  // A flat row of x copied into `padded`, zeros after it, where x is narrower than K.
  void prepare_row(int64_t flat) {
    const auto [g, j] = row(flat);
    const Update& u = us[g];
    const int64_t in = x.size(1);
    if (in == u.K) return;
    float* out = padded.data() + flat * u.K;
    std::copy_n(x.data_ptr<float>() + u.rows[j] * in, in, out);
    std::fill(out + in, out + u.K, 0.0f);
  }

  // Group g's row j of x, K wide.
  const float* x_row(int64_t g, int64_t j) const {
    const Update& u = us[g];
    const int64_t in = x.size(1);
    if (in == u.K) return x.data_ptr<float>() + u.rows[j] * in;
    return padded.data() + (first[g] + j) * u.K;
  }

  // The b loop's task: a group's part and its outputs [o, o + width).
  struct Chunk {
    int64_t g, p, o, width;
  };
  Chunk chunk(int64_t flat) const {
    const int64_t g = &locate(us, flat, [](const Update& v) { return v.chunks; }) - us.data();
    const Update& u = us[g];
    int64_t p = 0;
    while (flat >= u.part_chunks(p)) flat -= u.part_chunks(p++);
    const int64_t o = flat * kChunk;
    return {g, p, o, std::min(kChunk, u.out[p] - o)};
  }

  // The a loop's task: Q rows of a group and one tile of 16 ranks, by the form's a_tile.
  template <typename Tile>
  void a_task(int64_t task, Tile&& tile) const {
    int64_t i = task;
    const int64_t g = &locate(us, i, [](const Update& v) { return v.tasks(); }) - us.data();
    const Update& u = us[g];
    const int64_t r0 = (i % u.rank_tiles) * kRankTile, j0 = (i / u.rank_tiles) * kRowTile;
    const float* xr[kRowTile];
    float* out[kRowTile];
    const int64_t count = std::min(kRowTile, u.n - j0);
    for (int64_t q = 0; q < count; ++q) {
      xr[q] = x_row(g, j0 + q);
      out[q] = low.data() + u.low + (j0 + q) * u.R + r0;
    }
    tile(u, count, xr, r0, out);
  }
};

// ---- float32 form (AVX2) ----

// Byte i of each 32-bit lane, sign-extended, as float.
template <int I>
inline __m256 lane_byte(__m256i v) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * I), 24));
}

// Q rows' low-rank activations for one tile of 16 ranks: per four inputs, the tile's 64 bytes
// (two 8-lane halves) loaded once for all rows.
template <int Q>
void a_tile_avx2(const Update& u, const float* const* xr, int64_t r0, float* const* out) {
  __m256 acc[Q][2];
  for (int q = 0; q < Q; ++q) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
  const int8_t* w = u.a + r0 * u.K;  // tile r0 / 16: K / 4 groups of 64 bytes
  for (int64_t k = 0; k < u.K; k += 4, w += 64) {
    const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
    const __m256 w00 = lane_byte<0>(h0), w01 = lane_byte<1>(h0), w02 = lane_byte<2>(h0),
                 w03 = lane_byte<3>(h0);
    const __m256 w10 = lane_byte<0>(h1), w11 = lane_byte<1>(h1), w12 = lane_byte<2>(h1),
                 w13 = lane_byte<3>(h1);
    for (int q = 0; q < Q; ++q) {
      const float* xq = xr[q] + k;
      const __m256 x0 = _mm256_broadcast_ss(xq), x1 = _mm256_broadcast_ss(xq + 1);
      const __m256 x2 = _mm256_broadcast_ss(xq + 2), x3 = _mm256_broadcast_ss(xq + 3);
      acc[q][0] = _mm256_fmadd_ps(x0, w00, acc[q][0]);
      acc[q][1] = _mm256_fmadd_ps(x0, w10, acc[q][1]);
      acc[q][0] = _mm256_fmadd_ps(x1, w01, acc[q][0]);
      acc[q][1] = _mm256_fmadd_ps(x1, w11, acc[q][1]);
      acc[q][0] = _mm256_fmadd_ps(x2, w02, acc[q][0]);
      acc[q][1] = _mm256_fmadd_ps(x2, w12, acc[q][1]);
      acc[q][0] = _mm256_fmadd_ps(x3, w03, acc[q][0]);
      acc[q][1] = _mm256_fmadd_ps(x3, w13, acc[q][1]);
    }
  }
  const __m256 s0 = _mm256_loadu_ps(u.a_scale + r0), s1 = _mm256_loadu_ps(u.a_scale + r0 + 8);
  for (int q = 0; q < Q; ++q) {
    _mm256_storeu_ps(out[q], _mm256_mul_ps(acc[q][0], s0));
    _mm256_storeu_ps(out[q] + 8, _mm256_mul_ps(acc[q][1], s1));
  }
}

// Q rows' outputs [o, o + 8 v) of part p (each 8-output vector one 32-byte load per four ranks);
// lj[q]: row q's low-rank activations of the part, B's scales in.
template <int Q>
void b_chunk_avx2(const Update& u, int64_t p, int64_t o, const float* const* lj, float* const* yj) {
  constexpr int V = kChunk / 8;
  __m256 acc[Q][V];
  for (int q = 0; q < Q; ++q) {
    for (int v = 0; v < V; ++v) acc[q][v] = _mm256_loadu_ps(yj[q] + 8 * v);
  }
  const int8_t* chunk = u.b[p] + (o / kChunk) * u.r[p] * kChunk;  // r / 4 groups of 128 bytes
  for (int64_t k = 0; k < u.r[p]; k += 4) {
    const int8_t* w = chunk + k * kChunk;
    for (int v = 0; v < V; ++v) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      const __m256 w0 = lane_byte<0>(h), w1 = lane_byte<1>(h), w2 = lane_byte<2>(h),
                   w3 = lane_byte<3>(h);
      for (int q = 0; q < Q; ++q) {
        acc[q][v] = _mm256_fmadd_ps(_mm256_set1_ps(lj[q][k]), w0, acc[q][v]);
        acc[q][v] = _mm256_fmadd_ps(_mm256_set1_ps(lj[q][k + 1]), w1, acc[q][v]);
        acc[q][v] = _mm256_fmadd_ps(_mm256_set1_ps(lj[q][k + 2]), w2, acc[q][v]);
        acc[q][v] = _mm256_fmadd_ps(_mm256_set1_ps(lj[q][k + 3]), w3, acc[q][v]);
      }
    }
  }
  for (int q = 0; q < Q; ++q) {
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(yj[q] + 8 * v, acc[q][v]);
  }
}

// `count` (1 to kRowTile) rows at once, the count a compile-time constant.
template <typename F>
inline void with_rows(int64_t count, F&& f) {
  switch (count) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

struct FloatForm {
  Step& s;
  float* y;
  int64_t N;

  void size() {}
  void between_row(int64_t) {}

  void a_task(int64_t task) {
    s.a_task(task, [](const Update& u, int64_t count, const float* const* xr, int64_t r0,
                      float* const* out) {
      with_rows(count, [&](auto q) { a_tile_avx2<decltype(q)::value>(u, xr, r0, out); });
    });
  }

  void b_task(int64_t flat) {
    const auto [g, p, o, width] = s.chunk(flat);
    const Update& u = s.us[g];
    const int64_t r = u.r[p];
    float lj[kRowTile][kMaxRank];
    for (int64_t j0 = 0; j0 < u.n; j0 += kRowTile) {
      const int64_t count = std::min(kRowTile, u.n - j0);
      const float* l[kRowTile];
      float* yj[kRowTile];
      for (int64_t q = 0; q < count; ++q) {
        const float* lowj = s.low.data() + u.low + (j0 + q) * u.R + u.rank_start[p];
        for (int64_t k = 0; k < r; ++k) lj[q][k] = lowj[k] * u.b_scale[p][k];
        l[q] = lj[q];
        yj[q] = y + u.rows[j0 + q] * N + u.start[p] + o;
      }
      if (width == kChunk) {
        with_rows(count, [&](auto q) { b_chunk_avx2<decltype(q)::value>(u, p, o, l, yj); });
        continue;
      }
      for (int64_t q = 0; q < count; ++q) {  // the part's last, narrower chunk
        for (int64_t e = 0; e < width; ++e) {
          float acc = 0.0f;
          const int8_t* lane = u.b[p] + o * r + 4 * e;  // the chunk's, then the lane's
          for (int64_t k = 0; k < r; ++k) acc += l[q][k] * lane[(k / 4) * 4 * kChunk + k % 4];
          yj[q][e] += acc;
        }
      }
    }
  }
};

// ---- integer form (AVX-512 VNNI) ----

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma")

// Rows of activations as two int8 digits per value (quant_vnni.cpp's quantize_activations),
// quantized row by row.
struct Digits {
  std::vector<int8_t> hi, lo;
  std::vector<float> scale, rounded_sum;
  std::vector<int32_t> hi_sum16, lo_sum16;
  int64_t K = 0;

  void size(int64_t T, int64_t width) {
    K = width;
    const size_t nb = static_cast<size_t>(T * K / kBlock);
    hi.resize(static_cast<size_t>(T * K));
    lo.resize(static_cast<size_t>(T * K));
    scale.resize(nb);
    rounded_sum.resize(nb);
    hi_sum16.resize(2 * nb);
    lo_sum16.resize(2 * nb);
  }
  void quantize_row(int64_t t, const float* x) {
    const int64_t nb = K / kBlock;
    Int8Digits view{hi.data() + t * K,       lo.data() + t * K,
                    scale.data() + t * nb,   hi_sum16.data() + 2 * t * nb,
                    lo_sum16.data() + 2 * t * nb, rounded_sum.data() + t * nb, 2};
    quantize_activations(x, 1, K, view);
  }
  // Block b of row t: the offset's term, 128 times (254 hi + lo) summed over the block.
  int32_t offset(int64_t t, int64_t b) const {
    const int64_t i = t * (K / kBlock) + b;
    return 128 * (254 * (hi_sum16[2 * i] + hi_sum16[2 * i + 1]) + lo_sum16[2 * i] +
                  lo_sum16[2 * i + 1]);
  }
  int32_t hi4(int64_t t, int64_t k) const {
    return *reinterpret_cast<const int32_t*>(hi.data() + t * K + k);
  }
  int32_t lo4(int64_t t, int64_t k) const {
    return *reinterpret_cast<const int32_t*>(lo.data() + t * K + k);
  }
};

// Weights read as unsigned bytes (w + 128); the offset comes off each block's sum exactly.
inline __m512i unsigned_bytes(__m512i w) { return _mm512_xor_si512(w, _mm512_set1_epi8(-128)); }

// A block's float sum: scale * (254 hi_sum + lo_sum - offset), exact in int32 first.
inline __m512 block_sum(__m512i hi, __m512i lo, int32_t offset, float scale, __m512 acc) {
  const __m512i total = _mm512_sub_epi32(
      _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), _mm512_slli_epi32(hi, 1)), lo),
      _mm512_set1_epi32(offset));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(scale), acc);
}

// Byte i of each 32-bit lane, sign-extended, as float.
template <int I>
inline __m512 lane_byte16(__m512i v) {
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * I), 24));
}

// Q rows' low-rank activations for one tile of 16 ranks, in float32 multiply-adds: a's ranks
// are few (16-64 a projection), so rounding each row's x to digits would cost as much as the
// products. Per four inputs one 64-byte load serves every row; four sums a row (one per input
// of the four, added at the end, whatever Q) keep the FMAs' latency off the path.
template <int Q>
void a_tile_avx512(const Update& u, const float* const* xr, int64_t r0, float* const* out) {
  __m512 acc[Q][4];
  for (int q = 0; q < Q; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = _mm512_setzero_ps();
  const int8_t* w = u.a + r0 * u.K;  // tile r0 / 16: K / 4 groups of 64 bytes
  for (int64_t k = 0; k < u.K; k += 4, w += 64) {
    const __m512i v = _mm512_loadu_si512(w);
    const __m512 w0 = lane_byte16<0>(v), w1 = lane_byte16<1>(v), w2 = lane_byte16<2>(v),
                 w3 = lane_byte16<3>(v);
    for (int q = 0; q < Q; ++q) {
      const float* xq = xr[q] + k;
      acc[q][0] = _mm512_fmadd_ps(_mm512_set1_ps(xq[0]), w0, acc[q][0]);
      acc[q][1] = _mm512_fmadd_ps(_mm512_set1_ps(xq[1]), w1, acc[q][1]);
      acc[q][2] = _mm512_fmadd_ps(_mm512_set1_ps(xq[2]), w2, acc[q][2]);
      acc[q][3] = _mm512_fmadd_ps(_mm512_set1_ps(xq[3]), w3, acc[q][3]);
    }
  }
  const __m512 scale = _mm512_loadu_ps(u.a_scale + r0);
  for (int q = 0; q < Q; ++q) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[q][0], acc[q][1]),
                                     _mm512_add_ps(acc[q][2], acc[q][3]));
    _mm512_storeu_ps(out[q], _mm512_mul_ps(sum, scale));
  }
}

// Q rows' outputs [o, o + width) of part p, two 16-lane vectors; l: the rows' low-rank
// activations of the part as digits (rows lrow[q] of `l`, K = the padded rank).
template <int Q>
void b_chunk_vnni(const Update& u, int64_t p, int64_t o, int64_t width, const Digits& l,
                  const int64_t* lrow, float* const* yj) {
  const __mmask16 m0 = static_cast<__mmask16>(width >= 16 ? 0xFFFF : (1u << width) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(width >= 32 ? 0xFFFF : width <= 16 ? 0 : (1u << (width - 16)) - 1);
  __m512 acc[Q][2];
  for (int q = 0; q < Q; ++q) {
    acc[q][0] = _mm512_maskz_loadu_ps(m0, yj[q]);
    acc[q][1] = _mm512_maskz_loadu_ps(m1, yj[q] + 16);
  }
  const int64_t r = u.r[p];
  const int8_t* chunk = u.b[p] + (o / kChunk) * r * kChunk;  // r / 4 groups of 128 bytes
  for (int64_t b = 0; b * kBlock < r; ++b) {
    __m512i hi[Q][2], lo[Q][2];
    for (int q = 0; q < Q; ++q) hi[q][0] = hi[q][1] = lo[q][0] = lo[q][1] = _mm512_setzero_si512();
    for (int64_t k = b * kBlock; k < std::min(r, (b + 1) * kBlock); k += 4) {
      const int32_t* w = reinterpret_cast<const int32_t*>(chunk + k * kChunk);
      const __m512i w0 = unsigned_bytes(_mm512_maskz_loadu_epi32(m0, w));
      const __m512i w1 = unsigned_bytes(_mm512_maskz_loadu_epi32(m1, w + 16));
      for (int q = 0; q < Q; ++q) {
        const __m512i h = _mm512_set1_epi32(l.hi4(lrow[q], k)), d = _mm512_set1_epi32(l.lo4(lrow[q], k));
        hi[q][0] = _mm512_dpbusd_epi32(hi[q][0], w0, h);
        lo[q][0] = _mm512_dpbusd_epi32(lo[q][0], w0, d);
        hi[q][1] = _mm512_dpbusd_epi32(hi[q][1], w1, h);
        lo[q][1] = _mm512_dpbusd_epi32(lo[q][1], w1, d);
      }
    }
    for (int q = 0; q < Q; ++q) {
      const int64_t i = lrow[q] * (l.K / kBlock) + b;
      for (int v = 0; v < 2; ++v) {
        acc[q][v] = block_sum(hi[q][v], lo[q][v], l.offset(lrow[q], b), l.scale[i], acc[q][v]);
      }
    }
  }
  for (int q = 0; q < Q; ++q) {
    _mm512_mask_storeu_ps(yj[q], m0, acc[q][0]);
    _mm512_mask_storeu_ps(yj[q] + 16, m1, acc[q][1]);
  }
}

struct IntegerForm {
  Step& s;
  float* y;
  int64_t N;
  // Per group, each row's and part's low-rank activations (B's scales in), row j's part p at
  // row j * parts + p, its ranks zero-padded to whole blocks.
  std::vector<Digits>& l;

  void size() {
    if (l.size() < s.us.size()) l.resize(s.us.size());
    for (size_t g = 0; g < s.us.size(); ++g) {
      const Update& u = s.us[g];
      int64_t width = 0;
      for (int64_t p = 0; p < u.parts; ++p) width = std::max(width, round_up(u.r[p], kBlock));
      l[g].size(u.n * u.parts, width);
    }
  }
  void between_row(int64_t flat) {
    const auto [g, j] = s.row(flat);
    const Update& u = s.us[g];
    float row[kMaxRank + kBlock];
    for (int64_t p = 0; p < u.parts; ++p) {
      const float* lowj = s.low.data() + u.low + j * u.R + u.rank_start[p];
      std::fill_n(row, l[g].K, 0.0f);
      for (int64_t k = 0; k < u.r[p]; ++k) row[k] = lowj[k] * u.b_scale[p][k];
      l[g].quantize_row(j * u.parts + p, row);
    }
  }

  void a_task(int64_t task) {
    s.a_task(task, [](const Update& u, int64_t count, const float* const* xr, int64_t r0,
                      float* const* out) {
      with_rows(count, [&](auto q) { a_tile_avx512<decltype(q)::value>(u, xr, r0, out); });
    });
  }

  void b_task(int64_t flat) {
    const auto [g, p, o, width] = s.chunk(flat);
    const Update& u = s.us[g];
    for (int64_t j0 = 0; j0 < u.n; j0 += kRowTile) {
      const int64_t count = std::min(kRowTile, u.n - j0);
      int64_t lrow[kRowTile];
      float* yj[kRowTile];
      for (int64_t q = 0; q < count; ++q) {
        lrow[q] = (j0 + q) * u.parts + p;
        yj[q] = y + u.rows[j0 + q] * N + u.start[p] + o;
      }
      with_rows(count, [&](auto q) {
        b_chunk_vnni<decltype(q)::value>(u, p, o, width, l[g], lrow, yj);
      });
    }
  }
};

#pragma GCC pop_options

// Every group's update of one projection (a decode step makes four per layer, whatever the
// number of adapters in it): the low-rank activations of every group first, then, after the
// loop's barrier, every group's outputs in chunks of kChunk.
template <typename Form>
void update(Form& form) {
  Step& s = form.s;
  if (s.tasks == 0) return;
  form.size();
  if (s.work < kOneThreadWork) {  // no OpenMP region at all: see kOneThreadWork
    for (int64_t j = 0; j < s.rows; ++j) s.prepare_row(j);
    for (int64_t task = 0; task < s.tasks; ++task) form.a_task(task);
    for (int64_t j = 0; j < s.rows; ++j) form.between_row(j);
    for (int64_t c = 0; c < s.chunks; ++c) form.b_task(c);
    return;
  }
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(static)
    for (int64_t j = 0; j < s.rows; ++j) s.prepare_row(j);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < s.tasks; ++task) form.a_task(task);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < s.rows; ++j) form.between_row(j);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < s.chunks; ++c) form.b_task(c);
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
  // Buffers kept between calls (a decode step makes 120 on SmolLM2): no allocation per call.
  thread_local std::vector<float> low, padded;
  thread_local std::vector<Digits> l_digits;
  Step step(us, x, low, padded);
  float* ys = y.data_ptr<float>();
  if (active_isa() >= kVnni) {
    IntegerForm form{step, ys, y.size(1), l_digits};
    update(form);
  } else {
    FloatForm form{step, ys, y.size(1)};
    update(form);
  }
}

}  // namespace

void lora_add_groups(at::Tensor& y, const at::Tensor& x, const std::vector<LoraGroup>& groups) {
  check_y_x(y, x);
  std::vector<Update> us;
  for (const LoraGroup& g : groups) {
    const int64_t* rec = record(g);
    if (rec[0] != 0) us.push_back(from_record(y, x, g, rec));  // parts 0: no update here
  }
  run(y, x, us);
}

void lora_add_(at::Tensor& y, const at::Tensor& x, at::TensorList rows, at::TensorList packs,
               at::IntArrayRef entries) {
  const int64_t G = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(packs.size()) == G * kLoraPackTensors &&
                  static_cast<int64_t>(entries.size()) == G,
              "lora_add_: per group its rows, a pack of ", kLoraPackTensors,
              " tensors and an entry");
  std::vector<LoraGroup> groups;
  for (int64_t g = 0; g < G; ++g) {
    groups.push_back({&rows[g], packs.data() + g * kLoraPackTensors, entries[g]});
  }
  lora_add_groups(y, x, groups);
}

}  // namespace jitney_kernels

TORCH_LIBRARY_IMPL(jitney, CPU, m) {
  m.impl("lora_add_", &jitney_kernels::lora_add_);
}
