"""A GGUF file's tensors under transformers' names, as the file stores them (not dequantized).

`read_gguf_tensors(path)` maps ggml's names (`blk.3.attn_q.weight`) to the names the transformers
model of the file's architecture gives them (`model.layers.3.self_attn.q_proj.weight`) and gives
each tensor's raw rows as the file holds them (memory-mapped): a quantized matrix is [out, bytes
per row], whole blocks of 32 weights along the input dimension, so rows can be reordered or
concatenated without dequantizing.

What llama.cpp's converter (convert_hf_to_gguf.py) changed on the way in is undone here, so the
tensors are the transformers model's:
- a `llama` (or `smollm3`) file's Q and K rows are permuted for its rotary layout (each head's
  two halves interleaved): `GGUFTensor.rows` takes them back in order, as transformers' own GGUF
  loader does for the weights it dequantizes;
- Gemma 3 stores each RMSNorm weight w as 1 + w (its norm multiplies by 1 + w): `GGUFTensor`
  subtracts the 1 again when it dequantizes;
- the names differ by architecture: Gemma 3's `ffn_norm` is the norm before the MLP (Llama's is
  the norm after attention), Phi-3 keeps Q, K and V in one `attn_qkv` and the MLP's gate and up
  in one `ffn_up` (transformers' `qkv_proj` and `gate_up_proj`), and its LongRoPE factors are
  tensors (`rope_factors_long/short`) that belong to the config (engine/models/gguf_config.py),
  not to the weights, as does a Llama 3's `rope_freqs`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from engine.models.gguf_index import GGUFIndex, read_gguf_index, release_pages

# ggml name within a block -> transformers name, by architecture (the Llama family's below)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ARCH_LAYER_NAMES = {
    "gemma3": _LAYER_NAMES
    | {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "phi3": _LAYER_NAMES
    | {
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_qkv.bias": "self_attn.qkv_proj.bias",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that describe the model rather than weigh it (read into its config: Phi-3's LongRoPE
# factors, Llama 3's llama3 RoPE divisors).
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
# Architectures whose Q and K rows the converter permuted (its LlamaModel and subclasses).
_PERMUTED_ARCHS = ("llama", "smollm3")
# Architectures whose RMSNorm weights the converter stored as 1 + w.
_SHIFTED_NORM_ARCHS = ("gemma3",)
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file: `kind` is ggml's type name ("Q4_1", "Q8_0", "F32", ...);
    `shape` is torch's order ([out, in] for a matrix); `raw` the file's rows."""

    name: str
    kind: str
    shape: tuple[int, ...]
    raw: np.ndarray  # [rows, bytes per row] for quantized types, the values for float ones
    qtype: int  # ggml's type id (gguf.GGMLQuantizationType)
    row_order: np.ndarray | None = None  # rows to take, in order (the Q/K un-permutation)
    shift: float = 0.0  # added to every value when dequantized (Gemma's norms: -1)

    def rows(self) -> np.ndarray:
        """The raw rows in transformers' order."""
        return self.raw if self.row_order is None else self.raw[self.row_order]

    def release(self) -> None:
        """Its file pages out of this process, once its blocks are packed or dequantized."""
        release_pages(self.raw)

    def dequantize(self) -> torch.Tensor:
        """float32, transformers' layout and order."""
        from gguf.quants import dequantize

        values = np.asarray(dequantize(self.rows(), self.qtype), dtype=np.float32)
        if self.shift:
            values = values + np.float32(self.shift)
        return torch.from_numpy(values.reshape(self.shape).copy())


def rotary_row_order(num_rows: int, num_heads: int) -> np.ndarray:
    """Row i of transformers' Q (or K) matrix is row order[i] of llama.cpp's: head h's row
    (h, half s, j) sits at (h, j, s) in the file."""
    head_dim = num_rows // num_heads
    h, s, j = np.meshgrid(
        np.arange(num_heads), np.arange(2), np.arange(head_dim // 2), indexing="ij"
    )
    return (h * head_dim + j * 2 + s).reshape(-1)


def read_gguf_tensors(path: str | Path) -> tuple[str, dict[str, GGUFTensor]]:
    """(the file's architecture, its tensors by transformers name)."""
    index = read_gguf_index(path)
    return _field(index.metadata, "general.architecture", str), gguf_tensors(index)


def gguf_tensors(index: GGUFIndex) -> dict[str, GGUFTensor]:
    """An indexed file's weights by transformers name (CONFIG_TENSORS left out). Raises
    ValueError for a tensor this mapping does not know (rather than silently dropping
    weights)."""
    from gguf import GGMLQuantizationType

    arch = _field(index.metadata, "general.architecture", str)
    num_heads = _field(index.metadata, f"{arch}.attention.head_count", int)
    num_kv_heads = _field(index.metadata, f"{arch}.attention.head_count_kv", int, num_heads)
    tensors: dict[str, GGUFTensor] = {}
    for t in index.tensors:
        if t.name in CONFIG_TENSORS:
            continue
        name = _hf_name(arch, t.name)
        shape = tuple(reversed(t.dims))  # ggml lists dims inner first
        order = None
        if arch in _PERMUTED_ARCHS and name.endswith(_ROTATED):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            order = rotary_row_order(shape[0], heads)
        shift = -1.0 if arch in _SHIFTED_NORM_ARCHS and name.endswith("norm.weight") else 0.0
        kind = GGMLQuantizationType(t.qtype).name
        tensors[name] = GGUFTensor(name, kind, shape, t.data, t.qtype, order, shift)
    return tensors


_ROTATED = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")


def _hf_name(arch: str, ggml_name: str) -> str:
    if ggml_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[ggml_name]
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    match = _BLOCK.match(ggml_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"GGUF tensor {ggml_name!r} has no counterpart in a {arch} model")
    return f"model.layers.{match.group(1)}.{names[match.group(2)]}"


def _field(metadata: dict[str, object], key: str, kind: type[T], default: T | None = None) -> T:
    value = metadata.get(key, default)
    if value is None:
        raise ValueError(f"GGUF file has no {key!r}")
    if not isinstance(value, kind):
        raise ValueError(f"GGUF file's {key!r} is {value!r}, not a {kind.__name__}")
    return value
