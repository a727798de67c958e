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

// lora_add.cpp: adapters' low-rank updates of a projection, each added to its group's rows.
// An adapter is a pack (engine/lora/adapter_set.py KernelPack) of kLoraPackTensors tensors:
// int8 weights, float32 scales and int64 records [entries, kLoraRecordInts], one record per
// update: parts (0: none), K, R, A's offset and its scales', then per part its B's offset and
// its scales', rank r, column start, rank start and width.
constexpr int64_t kLoraMaxParts = 3;  // Q, K, V
constexpr int64_t kLoraPackTensors = 3;
constexpr int64_t kLoraRecordInts = 5 + 6 * kLoraMaxParts;
// One group: its rows, its adapter's pack and the record of this projection's update.
struct LoraGroup {
  const at::Tensor* rows;
  const at::Tensor* pack;
  int64_t entry;
};
// Every group's update of one projection in one parallel region (groups with no update skipped).
void lora_add_groups(at::Tensor& y, const at::Tensor& x, const std::vector<LoraGroup>& groups);
void lora_add_(at::Tensor& y, const at::Tensor& x, at::TensorList rows, at::TensorList packs,
               at::IntArrayRef entries);

}  // namespace jitney_kernels
