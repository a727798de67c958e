// GGUF blocks as the kernels read them: the packed layout, the instruction sets, and the entry
// points each instruction set's file provides (quant_linear.cpp dispatches between them).
//
// Packed layout (engine/kernels/packed_weights.py packs it, engine/kernels/reference.py defines
// it in torch): a matrix of N rows and K = 32 * NB columns is G = ceil(N/16) groups of 16 rows; a
// group's NB records follow each other, groups follow each other, so a matrix is one stream.
// A record holds block b (elements 32b..32b+31) of the group's 16 rows, element-major, one row per
// lane of a 16-float vector:
//   Q4_1, 320 bytes:  [16 pairs][16 rows] uint8, low nibble element 2p, high nibble 2p+1;
//                     then d [16] f16, m [16] f16       (w = d * q + m)
//   Q8_0, 544 bytes:  [32 elements][16 rows] int8; then d [16] f16   (w = d * q)
// Rows past N (the last group's padding) have zero quants and scales.
#pragma once

#include <cstdint>
#include <type_traits>

namespace jitney_kernels {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;
// The one-pass kernels ask for the record this many ahead of the one they use (about 2 KiB of
// Q4_1): the hardware prefetchers alone fall behind a stream of 320-byte records.
constexpr int64_t kPrefetchRecords = 6;

enum class Kind : int { kQ4_1 = 0, kQ8_0 = 1 };  // engine/kernels/reference.py MATRIX_KINDS

constexpr int64_t record_bytes(Kind kind) { return kind == Kind::kQ4_1 ? 320 : 544; }
constexpr int64_t scales_offset(Kind kind) { return kind == Kind::kQ4_1 ? 256 : 512; }

struct PackedMatrix {
  const uint8_t* base;
  Kind kind;
  int64_t G, NB, N;  // groups, blocks per row, true rows (<= 16 G)
  int64_t K() const { return NB * kBlock; }
  const uint8_t* record(int64_t g, int64_t b) const {
    return base + (g * NB + b) * record_bytes(kind);
  }
  // Rows of group g that exist (16 but in a partial last group).
  int64_t rows_in(int64_t g) const { return N - g * kGroup < kGroup ? N - g * kGroup : kGroup; }
};

// The one-pass kernels' loop: f(std::integral_constant<int, TT>{}, t0) for each tile of TT tokens
// starting at t0 (kMax at a time, then the rest), so each tile size is its own unrolled instance.
template <int N, class F>
inline void last_tile(int64_t rest, int64_t t0, const F& f) {
  if constexpr (N > 0) {
    if (rest == N) {
      f(std::integral_constant<int, N>{}, t0);
    } else {
      last_tile<N - 1>(rest, t0, f);
    }
  }
}

template <int kMax, class F>
inline void token_tiles(int64_t T, const F& f) {
  int64_t t0 = 0;
  for (; t0 + kMax <= T; t0 += kMax) f(std::integral_constant<int, kMax>{}, t0);
  last_tile<kMax - 1>(T - t0, t0, f);
}

// The instruction sets the kernels are written for, in order; a CPU runs the highest it has
// (cpu_isa.cpp), or a lower one when capped (JITNEY_KERNEL_ISA, jitney_set_isa).
// kAvx2Int16 is no extra instruction set but AVX2's integer one pass (quant_avx2_int.cpp), every
// AVX2 CPU's default; kAvx2 keeps its exact float32 one pass (gemv_avx2), as kAvx512 does on
// AVX-512. kVnni: AVX-512 with VNNI and VBMI, whose one-pass kernel takes int8 activations
// (quant_vnni.cpp); kAmx implies it.
enum Isa : int { kAvx2 = 0, kAvx2Int16 = 1, kAvx512 = 2, kVnni = 3, kAmx = 4 };
int active_isa();

// y[t, n] for groups [g0, g1) and all T tokens, ldy = y's row stride; x [T, K] contiguous, sx
// [T, NB] the per-block sums of x (Q4_1's minimum term; nullptr for Q8_0).
void gemv_avx2(const PackedMatrix& w, const float* x, const float* sx, int64_t T, float* y,
               int64_t ldy, int64_t g0, int64_t g1);
void gemv_avx512(const PackedMatrix& w, const float* x, const float* sx, int64_t T, float* y,
                 int64_t ldy, int64_t g0, int64_t g1);
// Activations as int8 digits per value, per block of 32 (quant_vnni.cpp says why): with two,
// x ~ scale * (254 hi + lo); with one, x ~ scale * hi (lo and lo_sum unused); hi, lo [T, K];
// scale, the digits' sums, and (one digit) the rounded activations' sums scale * hi_sum, [T, NB].
struct Int8Digits {
  int8_t* hi;
  int8_t* lo;
  float* scale;
  int32_t* hi_sum;
  int32_t* lo_sum;
  float* rounded_sum;
  int digits;
};
void quantize_activations(const float* x, int64_t T, int64_t K, Int8Digits& out);
// The one pass with integer dot products (quant_vnni.cpp); sx as above, or with one digit the
// rounded activations' sums.
void gemv_vnni(const PackedMatrix& w, const Int8Digits& x, const float* sx, int64_t T, float* y,
               int64_t ldy, int64_t g0, int64_t g1);
// The same activations as one int16 each (quant_avx2_int.cpp): 254 hi + lo, or hi with one
// digit; values [T, K], scale and rounded_sum [T, NB] as Int8Digits'.
struct Int16Activations {
  int16_t* values;
  float* scale;
  float* rounded_sum;
  int digits;
};
// How many int8 digits the integer one passes give each activation: 2 (default) or 1
// (cpu_isa.cpp: JITNEY_ACTIVATION_DIGITS when the library loads, jitney_set_activation_digits).
int activation_digits();
// Tokens a tile of the AVX2 integer one pass serves from registers.
constexpr int kInt16Tile = 6;
void quantize_activations_int16(const float* x, int64_t T, int64_t K, Int16Activations& out);
void gemv_avx2_int16(const PackedMatrix& w, const Int16Activations& x, const float* sx, int64_t T,
                     float* y, int64_t ldy, int64_t g0, int64_t g1);
// The whole product with AMX tiles (bf16 weights and activations, float32 sums); xb is x in
// bf16, [ceil(T/16) * 16, K] with zero rows past T.
void amx_linear(const PackedMatrix& w, const uint16_t* xb, int64_t T, float* y, int64_t ldy);
void to_bf16_rows(const float* x, int64_t T, int64_t K, uint16_t* out);
bool amx_usable();  // the CPU has AMX-BF16 and the kernel let this process use its tiles

// Groups [g0, g1) dequantized into float32 columns: out[k * ldo + 16 (g - g0) + r] = w[16 g + r, k].
void dequantize_columns(const PackedMatrix& w, int64_t g0, int64_t g1, float* out, int64_t ldo);

}  // namespace jitney_kernels
