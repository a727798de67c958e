// GGUF blocks as the kernels read them: the block types' traits, the packed layout, the
// instruction sets, and the entry points each instruction set's file provides (quant_linear.cpp
// dispatches between them).
//
// Block types are data (engine/kernels/block_types.py documents the layout and holds the same
// table for the packer and the reference): per row and per 32 weights, unsigned levels u with a
// scale per sub-block and maybe a minimum, w = scale * (u - offset) + minimum. A kernel is one
// template per instruction set, instantiated per type, whose code reads the type's row below
// (`if constexpr` on its fields): the low plane (nibbles, or Q8_0's int8 quants), the bit planes
// adding bits 4 and 5, the scale's form (an f16 per sub-block, or a K-quant's integer times its
// super-block's f16 d), the minimum's form.
//
// Packed layout: a matrix of N rows and K = 32 * NB columns is G = ceil(N/16) groups of 16 rows;
// a group's NS = NB / per_super super-blocks follow each other, groups follow each other, so a
// matrix is one stream. A super-block is a header (K-quants: the 16 rows' d as f16, then their
// dmin) and per_super records; a record holds block b (elements 32b..32b+31) of the group's 16
// rows, element-major, one row per lane of a 16-float vector:
//   low plane   nibbles [16 pairs][16 rows], element 2p low, 2p+1 high (256 bytes), or
//               Q8_0's int8 quants [32 elements][16 rows] (512 bytes)
//   bit plane k [8 quads j] uint64, bit 4r + i = bit 4 + k of row r's level of element 4j + i
//   scales      per sub-block: f16 [16 rows], or uint8 / int8 [16 rows]
//   minimums    f16 [16 rows], or uint8 [16 rows]
// Rows past N (the last group's padding) have zero levels and scales.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

namespace jitney_kernels {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;
// The one-pass kernels ask for the record this many ahead of the one they use (about 2 KiB of
// Q4_1): the hardware prefetchers alone fall behind a stream of 320-byte records.
constexpr int64_t kPrefetchRecords = 6;

// The ops' `kind` (block_types.py's BlockType.code).
enum class Kind : int { kQ4_1 = 0, kQ8_0, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K, kQ4_0 };
constexpr int kNumKinds = 8;

enum class ScaleForm : int { kF16, kU8, kI8 };  // an f16 per sub-block, or int x super-block d
enum class MinForm : int { kNone, kF16, kU8 };  // none, an f16, or -(uint x super-block dmin)

struct BlockTraits {
  int lo_bits;    // 4: nibbles; 8: int8 quants (Q8_0)
  int hi_planes;  // bit planes adding bits 4, 5 of the level
  int offset;     // w = scale * (u - offset) + minimum
  int subs;       // scales per 32 weights (2: sub-blocks of 16)
  ScaleForm scale;
  MinForm min;
  constexpr int per_super() const { return scale == ScaleForm::kF16 ? 1 : 8; }
  constexpr int64_t lo_bytes() const { return lo_bits == 4 ? 256 : 512; }
  constexpr int64_t scales_offset() const { return lo_bytes() + 64 * hi_planes; }
  constexpr int64_t scale_bytes() const { return scale == ScaleForm::kF16 ? 32 : 16; }
  constexpr int64_t mins_offset() const { return scales_offset() + subs * scale_bytes(); }
  constexpr int64_t record_bytes() const {
    return mins_offset() + (min == MinForm::kF16 ? 32 : min == MinForm::kU8 ? 16 : 0);
  }
  constexpr int64_t header_bytes() const {
    return per_super() == 1 ? 0 : (min == MinForm::kU8 ? 64 : 32);
  }
  constexpr int64_t super_bytes() const { return header_bytes() + per_super() * record_bytes(); }
};

// One row per Kind, in its order.
constexpr BlockTraits kTraits[kNumKinds] = {
    {4, 0, 0, 1, ScaleForm::kF16, MinForm::kF16},   // Q4_1
    {8, 0, 0, 1, ScaleForm::kF16, MinForm::kNone},  // Q8_0
    {4, 1, 16, 1, ScaleForm::kF16, MinForm::kNone}, // Q5_0
    {4, 1, 0, 1, ScaleForm::kF16, MinForm::kF16},   // Q5_1
    {4, 0, 0, 1, ScaleForm::kU8, MinForm::kU8},     // Q4_K
    {4, 1, 0, 1, ScaleForm::kU8, MinForm::kU8},     // Q5_K
    {4, 2, 32, 2, ScaleForm::kI8, MinForm::kNone},  // Q6_K
    {4, 0, 8, 1, ScaleForm::kF16, MinForm::kNone},  // Q4_0
};
constexpr const BlockTraits& traits(Kind k) { return kTraits[static_cast<int>(k)]; }

// f(std::integral_constant<Kind, k>{}) for the runtime kind k: one instance of a kernel per type.
template <class F>
inline void with_kind(Kind k, const F& f) {
  switch (k) {
    case Kind::kQ4_1: f(std::integral_constant<Kind, Kind::kQ4_1>{}); break;
    case Kind::kQ8_0: f(std::integral_constant<Kind, Kind::kQ8_0>{}); break;
    case Kind::kQ5_0: f(std::integral_constant<Kind, Kind::kQ5_0>{}); break;
    case Kind::kQ5_1: f(std::integral_constant<Kind, Kind::kQ5_1>{}); break;
    case Kind::kQ4_K: f(std::integral_constant<Kind, Kind::kQ4_K>{}); break;
    case Kind::kQ5_K: f(std::integral_constant<Kind, Kind::kQ5_K>{}); break;
    case Kind::kQ6_K: f(std::integral_constant<Kind, Kind::kQ6_K>{}); break;
    case Kind::kQ4_0: f(std::integral_constant<Kind, Kind::kQ4_0>{}); break;
  }
}

struct PackedMatrix {
  const uint8_t* base;
  Kind kind;
  int64_t G, NB, N;  // groups, blocks per row, true rows (<= 16 G)
  int64_t K() const { return NB * kBlock; }
  int64_t group_bytes() const {
    const BlockTraits& t = traits(kind);
    return NB / t.per_super() * t.super_bytes();
  }
  int64_t bytes() const { return G * group_bytes(); }
  // Super-block s of group g: its header, then its records.
  const uint8_t* super(int64_t g, int64_t s) const {
    return base + g * group_bytes() + s * traits(kind).super_bytes();
  }
  const uint8_t* record(int64_t g, int64_t b) const {
    const BlockTraits& t = traits(kind);
    return super(g, b / t.per_super()) + t.header_bytes() + b % t.per_super() * t.record_bytes();
  }
  // Rows of group g that exist (16 but in a partial last group).
  int64_t rows_in(int64_t g) const { return N - g * kGroup < kGroup ? N - g * kGroup : kGroup; }
};

// Visits every record of group g in order, as f(rec, b, header): header is the record's
// super-block header (nullptr for types without one). The kernels' outer loop.
template <Kind kKind, class F>
inline void for_records(const PackedMatrix& w, int64_t g, const F& f) {
  constexpr BlockTraits T = traits(kKind);
  constexpr int P = T.per_super();
  const int64_t NS = w.NB / P;
  const uint8_t* sup = w.base + g * (NS * T.super_bytes());
  for (int64_t s = 0; s < NS; ++s, sup += T.super_bytes()) {
    const uint8_t* header = P > 1 ? sup : nullptr;
    const uint8_t* rec = sup + T.header_bytes();
    for (int r = 0; r < P; ++r, rec += T.record_bytes()) f(rec, s * P + r, header);
  }
}

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
// [T, NB] the per-block sums of x (the minimum term's other factor; nullptr for types without a
// minimum).
void gemv_avx2(const PackedMatrix& w, const float* x, const float* sx, int64_t T, float* y,
               int64_t ldy, int64_t g0, int64_t g1);
void gemv_avx512(const PackedMatrix& w, const float* x, const float* sx, int64_t T, float* y,
                 int64_t ldy, int64_t g0, int64_t g1);
// Activations as int8 digits per value, per block of 32 (quant_vnni.cpp says why): with two,
// x ~ scale * (254 hi + lo); with one, x ~ scale * hi (lo and lo_sum16 unused); hi, lo [T, K];
// scale and (one digit) the rounded activations' sums scale * (sum of hi), [T, NB]; the digits'
// sums per half block of 16 (the offset's term, per sub-block), [T, 2 NB].
struct Int8Digits {
  int8_t* hi;
  int8_t* lo;
  float* scale;
  int32_t* hi_sum16;
  int32_t* lo_sum16;
  float* rounded_sum;
  int digits;
  // The same buffers from token t on (K activations a token).
  Int8Digits from_token(int64_t t, int64_t K) const {
    const int64_t nb = t * (K / kBlock);
    return {hi + t * K,        lo ? lo + t * K : nullptr,
            scale + nb,        hi_sum16 + 2 * nb,
            lo_sum16 ? lo_sum16 + 2 * nb : nullptr,
            rounded_sum + nb,  digits};
  }
};
void quantize_activations(const float* x, int64_t T, int64_t K, Int8Digits& out);
// Tokens the VNNI one pass serves from registers at a time: token_tiles<kVnniTile> cuts T
// tokens into tiles of 8 and one of the rest.
constexpr int kVnniTile = 8;
// The activations of a projection in the order the VNNI one pass reads them, so that its
// unrolled loop finds each at a constant offset from one pointer a block (quant_vnni.cpp's
// gemv_group): tile by tile, the tile of TT tokens from t0 taking digits[t0 * K * D ...] as
// [NB][8 quads][TT][D digits][4 bytes], and scale[t0 * NB ...] as [NB][TT].
struct TiledDigits {
  int8_t* digits;
  float* scale;
  int per_value;  // D: 1 or 2
};
// Tokens [t_begin, t_end) of x (all T tokens' digits) copied into their tiles.
void tile_digits(const Int8Digits& x, int64_t T, int64_t K, int64_t t_begin, int64_t t_end,
                 TiledDigits& out);
// Where the one pass's integer sums start for a type whose levels carry an offset: per token
// and sub-block, -offset times the digits' sums over the sub-block (hi, then lo), tile by tile
// as TiledDigits ([NB * subs][TT][2] from 2 * t0 * NB * subs); left empty for a type without
// one. Once per projection and type (quant_vnni.cpp).
void offset_starts(Kind kind, const Int8Digits& x, int64_t T, int64_t NB,
                   std::vector<int32_t>& starts);
// The one pass with integer dot products (quant_vnni.cpp); start: offset_starts' for w's type
// (nullptr for a type without an offset); sx as above, or with one digit the rounded
// activations' sums.
void gemv_vnni(const PackedMatrix& w, const TiledDigits& x, const int32_t* start, const float* sx,
               int64_t T, float* y, int64_t ldy, int64_t g0, int64_t g1);
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
// Whether AMX's tiles take this type (written for Q4_1 and Q8_0 only); the others run the VNNI
// one pass at every token count on an AMX CPU.
inline bool amx_covers(Kind k) { return k == Kind::kQ4_1 || k == Kind::kQ8_0; }

}  // namespace jitney_kernels
