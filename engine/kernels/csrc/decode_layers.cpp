// jitney::llama_decode_layers_: every decoder layer of a decode-only step in one call.
//
// A decode step of a 135M model is ~10 small ops per layer; through Python each costs 5-8 us of
// dispatch on top of its work, about a quarter of a one-user step. This op runs the same layer
// ops (layer_ops.cpp, quant_linear.cpp) as engine/models/llama.py's fused path, in the same
// order, calling them as C++ functions: no Python, no dispatcher between them. It covers steps
// whose every row is one sequence's next token, attending in place (paged_decode_); anything
// else (prefill chunks, a gathered pool) stays on the Python path.
//
// tensors: kTensorsPerLayer per layer, in this order (an empty tensor: absent):
//   input_norm, post_norm, q_norm, k_norm,
//   then per matrix (qkv, o, gate_up, down): bias, then the blocks of each of its parts (up to
//   kMaxParts: a fused projection whose parts are of different block types keeps each)
// matrices: per layer and matrix, (parts, batched_min_tokens, kind of each part slot, rows of
//   each part slot), kMaxParts slots each, unused ones 0
// kv: the whole pool, [layers, 2 (K, V), blocks, block_size, KV, D]; windows: per layer, 0 = none
// What a family switches (engine/models/families.py): cos/sin, one [T, R] pair per rotary table,
// rope_tables naming each layer's (R: the rotated width, 0 for a layer without RoPE);
// out_norms, none or per layer the norms of the attention's and the MLP's outputs (Gemma);
// scale, the attention scores'; activation, the MLP's gate (0 SiLU, 1 GELU-tanh).
// LoRA (engine/lora/): lora_rows, per adapter group its rows of the step; lora, per group its
// adapter's pack (ops.h: kLoraPackTensors tensors), whose record layer * 4 + matrix is that
// matrix's update.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace {

using namespace jitney_kernels;

constexpr int64_t kVectors = 4;
constexpr int64_t kMatrices = 4;
constexpr int64_t kMaxParts = 3;  // Q, K, V
constexpr int64_t kTensorsPerMatrix = 1 + kMaxParts;
constexpr int64_t kIntsPerMatrix = 2 + 2 * kMaxParts;
constexpr int64_t kTensorsPerLayer = kVectors + kMatrices * kTensorsPerMatrix;

// A step's LoRA updates: each group's rows and its adapter's pack.
struct Lora {
  at::TensorList rows, packs;

  void add(at::Tensor& y, const at::Tensor& x, int64_t layer, int64_t matrix) const {
    if (rows.empty()) return;
    std::vector<LoraGroup> groups;
    for (size_t g = 0; g < rows.size(); ++g) {
      groups.push_back({&rows[g], packs.data() + g * kLoraPackTensors, layer * kMatrices + matrix});
    }
    lora_add_groups(y, x, groups);  // every adapter of the step in one parallel region
  }
};

at::Tensor linear(const at::Tensor& h, const at::Tensor* t, const int64_t* m) {
  const int64_t parts = m[0];
  at::Tensor y = quant_linear(h, at::TensorList(t + 1, parts), at::IntArrayRef(m + 2, parts),
                              at::IntArrayRef(m + 2 + kMaxParts, parts), m[1]);
  if (t[0].numel() > 0) y.add_(t[0]);
  return y;
}

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

void llama_decode_layers_(at::Tensor& x, at::TensorList tensors, at::IntArrayRef matrices,
                          at::TensorList cos, at::TensorList sin, const at::Tensor& slots,
                          at::Tensor& kv, const at::Tensor& block_tables, const at::Tensor& ctx_lens,
                          int64_t num_heads, int64_t num_kv_heads, double eps,
                          at::IntArrayRef windows, at::IntArrayRef rope_tables,
                          at::TensorList out_norms, double scale, int64_t activation,
                          at::TensorList lora_rows, at::TensorList lora) {
  const char* op = "llama_decode_layers_";
  const int64_t L = static_cast<int64_t>(windows.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(tensors.size()) == L * kTensorsPerLayer, op, ": ",
              tensors.size(), " tensors for ", L, " layers (", kTensorsPerLayer, " each)");
  TORCH_CHECK(static_cast<int64_t>(matrices.size()) == L * kMatrices * kIntsPerMatrix, op, ": ",
              matrices.size(), " matrix entries for ", L, " layers");
  for (int64_t i = 0; i < L * kMatrices; ++i) {
    const int64_t parts = matrices[i * kIntsPerMatrix];
    TORCH_CHECK(parts >= 1 && parts <= kMaxParts, op, ": a matrix of ", parts, " parts (1 to ",
                kMaxParts, ")");
  }
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, op, ": x must be contiguous [T, hidden]");
  TORCH_CHECK(kv.dim() == 6 && kv.size(0) == L && kv.size(1) == 2 && kv.is_contiguous(), op,
              ": kv must be the contiguous pool [", L, ", 2, blocks, block_size, KV, D]");
  TORCH_CHECK(cos.size() == sin.size() && static_cast<int64_t>(rope_tables.size()) == L, op,
              ": one cos and sin per rotary table, and a table per layer");
  for (const int64_t r : rope_tables) {
    TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(cos.size()), op, ": no rotary table ", r);
  }
  TORCH_CHECK(out_norms.empty() || static_cast<int64_t>(out_norms.size()) == 2 * L, op,
              ": out_norms must be empty or two per layer, got ", out_norms.size());
  TORCH_CHECK(activation == 0 || activation == 1, op, ": activation ", activation,
              " is neither 0 (SiLU) nor 1 (GELU-tanh)");
  TORCH_CHECK(lora.size() == kLoraPackTensors * lora_rows.size(), op, ": ", kLoraPackTensors,
              " LoRA tensors per group (a pack), got ", lora.size(), " for ", lora_rows.size());
  for (size_t g = 0; g < lora_rows.size(); ++g) {
    const at::Tensor& records = lora[g * kLoraPackTensors + 2];
    TORCH_CHECK(records.dim() == 2 && records.size(0) == L * kMatrices, op, ": group ", g,
                "'s pack must hold a record per layer and matrix (", L * kMatrices, ")");
  }
  const Lora adapters{lora_rows, lora};
  const int64_t T = x.size(0), H = num_heads, D = kv.size(5);
  const int64_t num_slots = kv.size(2) * kv.size(3);
  at::Tensor h = rms_norm(x, tensors[0], eps);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* t = tensors.data() + l * kTensorsPerLayer;
    const at::Tensor* w = t + kVectors;
    const int64_t* m = matrices.data() + l * kMatrices * kIntsPerMatrix;
    at::Tensor key_cache = kv.select(0, l).select(0, 0), value_cache = kv.select(0, l).select(0, 1);
    at::Tensor key_slots = key_cache.view({num_slots, num_kv_heads, D});
    at::Tensor value_slots = value_cache.view({num_slots, num_kv_heads, D});
    at::Tensor qkv = linear(h, w, m);
    adapters.add(qkv, h, l, 0);
    const int64_t table = rope_tables[l];
    const at::Tensor qk = rope_write_kv_(qkv, cos[table], sin[table], slots, key_slots,
                                         value_slots, H, num_kv_heads, present(t[2]),
                                         present(t[3]), eps);
    at::Tensor attn = at::empty({T, H, D}, x.options());
    paged_decode_(qk.narrow(1, 0, H), key_cache, value_cache, block_tables, ctx_lens, scale,
                  windows[l], attn);
    const at::Tensor attn_rows = attn.view({T, H * D});
    at::Tensor o = linear(attn_rows, w + kTensorsPerMatrix, m + kIntsPerMatrix);
    adapters.add(o, attn_rows, l, 1);
    if (!out_norms.empty()) o = rms_norm(o, out_norms[2 * l], eps);
    h = add_rms_norm_(x, o, t[1], eps);
    at::Tensor gu = linear(h, w + 2 * kTensorsPerMatrix, m + 2 * kIntsPerMatrix);
    adapters.add(gu, h, l, 2);
    const at::Tensor act = activation == 0 ? silu_mul(gu) : gelu_tanh_mul(gu);
    at::Tensor r = linear(act, w + 3 * kTensorsPerMatrix, m + 3 * kIntsPerMatrix);
    adapters.add(r, act, l, 3);
    if (!out_norms.empty()) r = rms_norm(r, out_norms[2 * l + 1], eps);
    if (l + 1 < L) {
      h = add_rms_norm_(x, r, tensors[(l + 1) * kTensorsPerLayer], eps);
    } else {
      x.add_(r);
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(jitney, CPU, m) { m.impl("llama_decode_layers_", &llama_decode_layers_); }
