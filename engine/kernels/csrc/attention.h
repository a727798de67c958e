// Decode attention's per-(sequence, KV head) loop for AVX-512 (attention_avx512.cpp), called by
// paged_decode_ (layer_ops.cpp) where the CPU runs AVX-512 and the head size is a multiple of 16.
#pragma once

#include <cstdint>

namespace jitney_kernels {

// G query heads (q, q_head_stride apart) of one KV head over positions [lo, hi): scores,
// softmax, weighted sum of values into out (out_head_stride apart). Keys and values are read in
// place: position p is slot p % bs of block table[p / bs]. scores: scratch of G rows of
// (hi - lo) rounded up to 16 floats.
void attend_one_avx512(const float* q, int64_t q_head_stride, const float* kc, const float* vc,
                       const int64_t* table, int64_t bs, int64_t block_stride, int64_t slot_stride,
                       int64_t lo, int64_t hi, int64_t G, int64_t D, float scale, float* out,
                       int64_t out_head_stride, float* scores);

}  // namespace jitney_kernels
