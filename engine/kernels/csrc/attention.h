// Decode attention's per-(sequence, KV head) loop, called by paged_decode_ (layer_ops.cpp): for
// AVX-512 where the CPU runs it and the head size is a multiple of 16 (attention_avx512.cpp),
// else for AVX2 (attention_avx2.cpp). The pool holds float32, bfloat16 or float16 keys and values
// (`--kv-cache-dtype`); each is widened to float32 as it is loaded, and all arithmetic is float32.
#pragma once

#include <cstdint>
#include <type_traits>

namespace jitney_kernels {

constexpr int64_t kMaxHeadVectors = 32;  // head sizes up to 256 floats (paged_decode_ checks)

// What one element of the pool is (its bits: float, or the 16 bits of a bfloat16 or float16).
enum class KVType { kFloat32, kBFloat16, kFloat16 };

// f(float{}) or f(uint16_t{}) with the tag of a 16-bit type: the element type the loops read.
struct BF16Tag {};
struct F16Tag {};
template <class F>
inline void by_kv_type(KVType t, const F& f) {
  if (t == KVType::kBFloat16) {
    f(BF16Tag{});
  } else if (t == KVType::kFloat16) {
    f(F16Tag{});
  } else {
    f(float{});
  }
}
template <class Tag>
using KVElem = std::conditional_t<std::is_same_v<Tag, float>, float, uint16_t>;

// f(std::integral_constant<int, D / kLanes>{}) for the common head sizes (64, 128), whose loops
// the compiler unrolls, else f(std::integral_constant<int, 0>{}): the head size read at run time.
template <int kLanes, class F>
inline void by_head_size(int64_t D, const F& f) {
  if (D == 64) {
    f(std::integral_constant<int, 64 / kLanes>{});
  } else if (D == 128) {
    f(std::integral_constant<int, 128 / kLanes>{});
  } else {
    f(std::integral_constant<int, 0>{});
  }
}

// Walks positions in order through the block table without a division per position.
struct Cursor {
  const int64_t* table;
  int64_t bs, block_stride, slot_stride, j, off;
  Cursor(const int64_t* t, int64_t bs_, int64_t blk, int64_t slot, int64_t p)
      : table(t), bs(bs_), block_stride(blk), slot_stride(slot), j(p / bs_), off(p % bs_) {}
  int64_t offset() const { return table[j] * block_stride + off * slot_stride; }
  void next() {
    if (++off == bs) {
      off = 0;
      ++j;
    }
  }
};

// G query heads (q, q_head_stride apart) of one KV head over positions [lo, hi): scores,
// softmax, weighted sum of values into out (out_head_stride apart). Keys and values (elements of
// kv_type) are read in place: position p is slot p % bs of block table[p / bs], the strides in
// elements. scores: scratch of G rows of (hi - lo) rounded up to 16 floats.
void attend_one_avx512(KVType kv_type, const float* q, int64_t q_head_stride, const void* kc,
                       const void* vc, const int64_t* table, int64_t bs, int64_t block_stride, int64_t slot_stride,
                       int64_t lo, int64_t hi, int64_t G, int64_t D, float scale, float* out,
                       int64_t out_head_stride, float* scores);

// The same for AVX2 (a head size that is a multiple of 8).
void attend_one_avx2(KVType kv_type, const float* q, int64_t q_head_stride, const void* kc,
                     const void* vc, const int64_t* table, int64_t bs, int64_t block_stride, int64_t slot_stride,
                     int64_t lo, int64_t hi, int64_t G, int64_t D, float scale, float* out,
                     int64_t out_head_stride, float* scores);

}  // namespace jitney_kernels
