// The jitney:: ops' C++ entry points, for the ops that call others without the dispatcher
// (decode_layers.cpp). Each is registered for the CPU at the end of its own file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace jitney_kernels {

// quant_linear.cpp: a projection of one or more parts side by side, each blocks packed as
// blocks.h says, of its kind (blocks.h's Kind) and row count.
at::Tensor quant_linear(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef kinds,
                        at::IntArrayRef rows, int64_t batched_min_tokens);

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gu);
at::Tensor gelu_tanh_mul(const at::Tensor& gu);
at::Tensor rope_write_kv_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& slots, at::Tensor& key_slots, at::Tensor& value_slots,
                          int64_t num_heads, int64_t num_kv_heads,
                          const std::optional<at::Tensor>& q_norm,
                          const std::optional<at::Tensor>& k_norm, double eps);
void paged_decode_(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                   int64_t window, at::Tensor& out);

// lora_add.cpp: one adapter's low-rank update of a projection, added to its rows of y; as a
// slot (kLoraSlotTensors tensors: a, each part's b and the scales, padded to kLoraMaxParts;
// kLoraSlotInts ints: the part count and each part's column start, rank start and width);
// every group's slot in one call.
constexpr int64_t kLoraMaxParts = 3;  // Q, K, V
constexpr int64_t kLoraSlotTensors = 2 * (1 + kLoraMaxParts);
constexpr int64_t kLoraSlotInts = 1 + 3 * kLoraMaxParts;
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& a,
               at::TensorList b, at::TensorList scales, at::IntArrayRef starts);
// One group's slot: its rows, its kLoraSlotTensors tensors and kLoraSlotInts ints.
struct LoraSlot {
  const at::Tensor* rows;
  const at::Tensor* tensors;
  const int64_t* ints;
};
// Every group's slot of one projection in one parallel region (unused slots skipped).
void lora_add_groups(at::Tensor& y, const at::Tensor& x, const std::vector<LoraSlot>& slots);
void lora_add_slots_(at::Tensor& y, const at::Tensor& x, at::TensorList rows, at::TensorList lora,
                     at::IntArrayRef lora_ints);

}  // namespace jitney_kernels
