"""The jitney:: ops: schemas, shapes for tracing, and which implementation runs them.

Each op is defined here once. Its pure-torch reference is registered for every device
(CompositeExplicitAutograd); the C++ library, when `ensure_backend()` manages to load it, adds a
CPU kernel, which the dispatcher prefers. The linears (a projection of one or more parts, each
in its own GGUF block type: engine/kernels/block_types.py) and the embedding serve the quantized
layers (engine/layers/quantized.py); argmax_rows and sample_rows the sampler
(engine/sampler.py); the rest are the per-layer steps of Jitney's CPU forward
(engine/models/llama.py) and its in-place decode attention (engine/attention/paged_attention.py).
The fake implementations give torch.compile the output shapes, so the ops stay opaque (one node
each) in a compiled graph. `batched_min_tokens` is the token count from which a linear runs its
batched path (AMX tiles, or dequantized panels and sgemm) instead of the one-pass kernel that
streams the weights once for a few tokens; 0 leaves the choice to the kernels, whose crossovers
were measured per instruction set (engine/kernels/csrc/quant_linear.cpp).
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import reference
from engine.kernels.block_types import BLOCK, block_type
from engine.kernels.build import KernelBackend, load_native

# name -> schema without the name. The linears and the embedding make new tensors; a name
# ending in "_" also writes into the arguments marked (a!)/(b!), as torch's in-place ops do.
SCHEMAS = {
    "quant_linear": (
        "(Tensor x, Tensor[] blocks, int[] kinds, int[] rows, int batched_min_tokens) -> Tensor"
    ),
    "quant_embedding": "(Tensor ids, Tensor blocks, int kind, int rows) -> Tensor",
    "argmax_rows": "(Tensor x) -> Tensor",
    "sample_rows": "(Tensor x, Tensor top_k, Tensor top_p, Tensor u) -> Tensor",
    "rms_norm": "(Tensor x, Tensor w, float eps) -> Tensor",
    "add_rms_norm_": "(Tensor(a!) x, Tensor r, Tensor w, float eps) -> Tensor",
    "silu_mul": "(Tensor gu) -> Tensor",
    "gelu_tanh_mul": "(Tensor gu) -> Tensor",
    "rope_write_kv_": (
        "(Tensor qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(a!) key_slots, "
        "Tensor(b!) value_slots, int num_heads, int num_kv_heads, Tensor? q_norm, "
        "Tensor? k_norm, float eps) -> Tensor"
    ),
    "paged_decode_": (
        "(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor ctx_lens, float scale, int window, Tensor(a!) out) -> ()"
    ),
    "llama_decode_layers_": (
        "(Tensor(a!) x, Tensor[] tensors, int[] matrices, Tensor[] cos, Tensor[] sin, "
        "Tensor slots, Tensor(b!) kv, Tensor block_tables, Tensor ctx_lens, int num_heads, "
        "int num_kv_heads, float eps, int[] windows, int[] rope_tables, Tensor[] out_norms, "
        "float scale, int activation, Tensor[] lora_rows, Tensor[] lora) -> ()"
    ),
    "lora_add_": "(Tensor(a!) y, Tensor x, Tensor[] rows, Tensor[] packs, int[] entries) -> ()",
}

# FRAGMENT: other modules may add their own jitney:: ops.
_LIB = torch.library.Library("jitney", "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    _LIB.define(f"{_name}{_schema}")
    _LIB.impl(_name, getattr(reference, _name), "CompositeExplicitAutograd")


@torch.library.register_fake("jitney::quant_linear")
def _quant_linear_fake(x, blocks, kinds, rows, batched_min_tokens):
    return x.new_empty(x.shape[0], sum(rows))


@torch.library.register_fake("jitney::quant_embedding")
def _quant_embedding_fake(ids, blocks, kind, rows):
    columns = blocks.shape[1] * BLOCK * block_type(kind).per_super
    return torch.empty(*ids.shape, columns, device=blocks.device)


@torch.library.register_fake("jitney::argmax_rows")
def _argmax_rows_fake(x):
    return x.new_empty(x.shape[0], dtype=torch.int64)


@torch.library.register_fake("jitney::sample_rows")
def _sample_rows_fake(x, top_k, top_p, u):
    return x.new_empty(x.shape[0], dtype=torch.int64)


@torch.library.register_fake("jitney::rms_norm")
def _rms_norm_fake(x, w, eps):
    return torch.empty_like(x)


@torch.library.register_fake("jitney::add_rms_norm_")
def _add_rms_norm_fake(x, r, w, eps):
    return torch.empty_like(x)


@torch.library.register_fake("jitney::silu_mul")
def _silu_mul_fake(gu):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


@torch.library.register_fake("jitney::gelu_tanh_mul")
def _gelu_tanh_mul_fake(gu):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


@torch.library.register_fake("jitney::rope_write_kv_")
def _rope_write_kv_fake(
    qkv, cos, sin, slots, key_slots, value_slots, num_heads, num_kv_heads, q_norm, k_norm, eps
):
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    return qkv.new_empty(qkv.shape[0], num_heads + num_kv_heads, head_dim)


@torch.library.register_fake("jitney::paged_decode_")
def _paged_decode_fake(q, key_cache, value_cache, block_tables, ctx_lens, scale, window, out):
    return None


@torch.library.register_fake("jitney::llama_decode_layers_")
def _llama_decode_layers_fake(
    x,
    tensors,
    matrices,
    cos,
    sin,
    slots,
    kv,
    block_tables,
    ctx_lens,
    num_heads,
    num_kv_heads,
    eps,
    windows,
    rope_tables,
    out_norms,
    scale,
    activation,
    lora_rows,
    lora,
):
    return None


@torch.library.register_fake("jitney::lora_add_")
def _lora_add_fake(y, x, rows, packs, entries):
    return None


@functools.cache
def kernel_backend() -> KernelBackend:
    """Load (building on first use) the C++ kernels once per process, and say which path serves
    the ops and why. Packing weights calls it, so a forward never builds."""
    return load_native()
