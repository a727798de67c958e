"""Jitney's own forward for the Llama family: Llama 2/3.x, SmolLM2, Qwen2, Qwen3, Mistral.

Written for the engine's packed step: every scheduled token of the batch is one row of a
[T, hidden] activation, sequence after sequence, at explicit positions; attention writes and reads
the paged pool through the same function the transformers path uses
(engine/attention/paged_attention.py). Per layer: RMSNorm, one fused QKV projection, (Qwen3) a
norm per head, rotary embeddings (angles made once per step), paged attention, the output
projection, RMSNorm, one fused gate/up projection, SiLU-and-multiply, the down projection, and
the residual adds. Only the rows whose logits are wanted reach the final norm and the LM head.

Two ways to run a layer, the same computation: in plain torch ops (`fused_ops=False`, the exact
mode: bit for bit the rounding of the transformers model on the same weights) or through the
jitney:: layer ops (engine/kernels/ops.py: one op per norm, per residual add and norm, per
rotary-and-cache-write, per SiLU-and-multiply), which cut a layer's dispatch from about sixty
torch ops to about ten; float32 on the CPU, for the quantized path, whose weights already differ
from the dense model's.

The model code says what is computed; how a projection stores its weights is its layer's business
(engine/layers/). The transformers model of the same family stays the reference: the
parity tests compare the two on the same weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention.step_inputs import AttentionMetadata
from engine.kernels.reference import DECODE_MAX_PARTS
from engine.kv_cache import PagedKVCache
from engine.layers.quantized import QuantizedLinear
from engine.models.llama_layer import (
    EAGER_STEPS,
    LlamaLayer,
    LlamaShape,
    compiled_steps,
    rms_norm,
)
from engine.models.weight_sources import StateDictWeights, WeightSource

# transformers model_type values this forward covers (each checked against its transformers
# model in tests/engine/test_llama_forward.py).
COVERED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE variants whose frequencies depend only on the config. "dynamic" and "longrope" rescale
# them with the sequence length (not covered: auto falls back to transformers for those).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedArchitectureError(ValueError):
    """A model Jitney's own forward does not cover (`--model-impl jitney` refuses it)."""


def unsupported_because(config: Any) -> str | None:
    """Why Jitney's forward cannot run a model of this transformers config (None: it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in COVERED_MODEL_TYPES:
        return f"architecture {model_type!r} is not covered (covered: {COVERED_MODEL_TYPES})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not covered (only silu)"
    rope_type = _rope_parameters(config).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} is not covered (covered: {STATIC_ROPE_TYPES})"
    return None


def _rope_parameters(config: Any) -> Mapping[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    # Per layer type (e.g. {"full_attention": {...}}) in some configs; one set for all here.
    if "rope_type" not in params and "rope_theta" not in params and params:
        params = next(iter(params.values()))
    return params


def _windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window, as the family's transformers model applies it."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # Qwen2/Qwen3: only "sliding_attention" layers slide
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if config.model_type == "mistral":  # every layer slides when the config sets a window
        return (window,) * num_layers
    return (None,) * num_layers


class Rotary(nn.Module):
    """Rotary position embeddings, computed as transformers computes them (position * inv_freq
    in float32, both halves, times the attention factor), so the rotation is the reference's
    bit for bit. cos/sin are made once per step for the step's positions and shared by every
    layer: no table, so any context length costs the same."""

    def __init__(self, config: Any):
        super().__init__()
        params = dict(_rope_parameters(config))
        rope_type = params.get("rope_type", "default")
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            factor = 1.0
        else:
            inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.factor = float(factor)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(cos, sin), each [T, 1, head_dim], for positions [T]."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


class LlamaForward(nn.Module):
    """A Llama-family decoder as one `ModelForward` (engine/models/forward.py): packed ids in,
    logits of the metadata's rows out."""

    def __init__(
        self, config: Any, weights: WeightSource, fused_ops: bool = False, compiled: bool = False
    ):
        super().__init__()
        why = unsupported_because(config)
        if why is not None:
            raise UnsupportedArchitectureError(why)
        num_heads = config.num_attention_heads
        self.config = config
        self.shape = LlamaShape(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            windows=_windows(config),
        )
        self.embed = weights.embedding("model.embed_tokens")
        self.layers = nn.ModuleList(
            LlamaLayer(self.shape, i, weights, f"model.layers.{i}.")
            for i in range(self.shape.num_layers)
        )
        self.norm = nn.Parameter(weights.vector("model.norm.weight"), requires_grad=False)
        # Tied embeddings (SmolLM2, Llama 3.2, Qwen3 small): the head multiplies by the table.
        tied = getattr(config, "tie_word_embeddings", False) or not weights.has("lm_head.weight")
        self.lm_head = weights.linear(["model.embed_tokens" if tied else "lm_head"])
        # Built on the CPU like any new module: moved to where the weights are (a GPU's).
        self.rotary = Rotary(config).to(self.norm.device)
        self.dtype = weights.dtype
        if fused_ops and self.dtype != torch.float32:
            raise ValueError(f"the jitney:: layer ops run in float32, not {self.dtype}")
        self.fused_ops = fused_ops
        if compiled and fused_ops:
            raise ValueError("--compile runs the dense forward; the quantized path's steps are C++")
        self.steps = compiled_steps() if compiled else EAGER_STEPS
        # What llama_decode_layers_ takes (every layer of a decode-only step in one C++ call):
        # built once; None where a layer is not quantized throughout (a dense fallback).
        self._decode_layers = _decode_layer_tensors(self.layers) if fused_ops else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
        hidden_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``input_ids``/``positions`` [T] (or [1, T]; positions None = the metadata's).
        Returns logits ``[S, vocab]`` for ``metadata.logits_indices`` only; with `hidden_rows`
        (`with_hidden`), also the final-norm hidden states of those rows."""
        pos = (metadata.positions if positions is None else positions).reshape(-1)
        with torch.inference_mode():
            x = self.embed(input_ids.reshape(-1))
            cos, sin = self.rotary.angles(pos, x.dtype)
            if self.fused_ops:
                x = self._layers_fused(x, cos.squeeze(1), sin.squeeze(1), metadata, kv_cache)
            else:
                for layer in self.layers:
                    x = layer(x, cos, sin, metadata, kv_cache, self.steps)
            rows = metadata.logits_indices
            if hidden_rows is None:
                return self.lm_head(rms_norm(x[rows], self.norm, self.shape.rms_norm_eps))
            # One final norm over both sets of rows (row-wise: each row as it would be alone).
            x = rms_norm(x[torch.cat((rows, hidden_rows))], self.norm, self.shape.rms_norm_eps)
            return self.lm_head(x[: rows.numel()]), x[rows.numel() :]

    def with_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
        hidden_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ModelForward.with_hidden: the logits, and the final-norm hidden states of rows
        `hidden_rows` of T (pooling)."""
        out = self(input_ids, positions, metadata, kv_cache, hidden_rows)
        assert isinstance(out, tuple)
        return out

    def _layers_fused(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Every layer through the jitney:: ops; each residual add is fused with the norm that
        follows it (the next layer's input norm, across layers), x updated in place. A
        decode-only step runs them as one jitney::llama_decode_layers_ call: the same ops, in
        the same order, without Python between them."""
        ops, s = torch.ops.jitney, self.shape
        eps = s.rms_norm_eps
        x = x.contiguous()
        if self._decode_layers is not None and _decode_only(meta, kv_cache, x.shape[0]):
            tensors, matrices = self._decode_layers
            group = meta.decodes[0]
            ops.llama_decode_layers_(
                x,
                tensors,
                matrices,
                cos,
                sin,
                meta.slot_mapping,
                kv_cache.pool,
                group.blocks.view(-1, group.num_blocks),
                meta.decode_ctx[group.members],
                s.num_heads,
                s.num_kv_heads,
                eps,
                [w or 0 for w in s.windows],
            )
            return x
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            h = ops.add_rms_norm_(
                x, layer.attention_fused(h, cos, sin, meta, kv_cache), layer.post_norm, eps
            )
            r = layer.mlp_fused(h)
            if i + 1 < len(self.layers):
                h = ops.add_rms_norm_(x, r, self.layers[i + 1].input_norm, eps)
            else:
                x.add_(r)
        return x

    @classmethod
    def from_transformers(cls, model: nn.Module, compiled: bool = False) -> LlamaForward:
        """The same weights as a loaded transformers model, in its dtype, held once: the fused
        projections are new tensors, and the transformers model's own Q/K/V and gate/up
        parameters become views of them (same values), so the reference still runs."""
        weights = StateDictWeights(dict(model.named_parameters()), share=True)
        return cls(model.config, weights, compiled=compiled)


def _decode_only(meta: AttentionMetadata, kv_cache: PagedKVCache, num_tokens: int) -> bool:
    """Whether every row of the step is one sequence's next token, all attending in place
    through the native kernel in one group, in row order."""
    if kv_cache.decode_kernel != "native" or meta.prefills or len(meta.decodes) != 1:
        return False
    return meta.decodes[0].rows == slice(0, num_tokens)


def _decode_layer_tensors(
    layers: Sequence[LlamaLayer],
) -> tuple[list[torch.Tensor], list[int]] | None:
    """llama_decode_layers_'s `tensors` and `matrices` (engine/kernels/reference.py says the
    order), or None where some projection is not a quantized layer."""
    empty = torch.empty(0)
    tensors: list[torch.Tensor] = []
    matrices: list[int] = []
    for layer in layers:
        tensors += [layer.input_norm, layer.post_norm]
        tensors += [empty if n is None else n for n in (layer.q_norm, layer.k_norm)]
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not isinstance(linear, QuantizedLinear) or len(linear.parts) > DECODE_MAX_PARTS:
                return None
            parts, unused = linear.parts, DECODE_MAX_PARTS - len(linear.parts)
            tensors += [empty if linear.bias is None else linear.bias]
            tensors += [p.blocks for p in parts] + [empty] * unused
            matrices += [len(parts), parts[0].batched_min_tokens]
            matrices += [p.code for p in parts] + [0] * unused
            matrices += [p.rows for p in parts] + [0] * unused
    return tensors, matrices
