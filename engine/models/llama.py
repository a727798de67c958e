"""Jitney's own forward for the Llama family: Llama 2/3.x, SmolLM2, Qwen2, Qwen3, Mistral, and
the families that are its layer with a few switches (engine/models/families.py): Gemma 3 (text),
Phi-3 / Phi-4-mini, SmolLM3.

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

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from engine.attention.step_inputs import AttentionMetadata
from engine.kernels.reference import DECODE_MAX_PARTS
from engine.kv_cache import PagedKVCache
from engine.layers.quantized import QuantizedLinear
from engine.lora.adapter_set import LoraTargets
from engine.lora.step_rows import StepAdapters
from engine.models.families import (
    UnsupportedArchitectureError,
    family_switches,
    head_dim_of,
    layer_windows,
    unsupported_because,
)
from engine.models.llama_layer import (
    EAGER_STEPS,
    LlamaLayer,
    LlamaShape,
    compiled_steps,
    norm_weight,
    rms_norm,
)
from engine.models.rotary import rotary_tables
from engine.models.weight_sources import StateDictWeights, WeightSource


class LlamaForward(nn.Module):
    """A Llama-family decoder as one `ModelForward` (engine/models/forward.py): packed ids in,
    logits of the metadata's rows out."""

    def __init__(
        self,
        config: Any,
        weights: WeightSource,
        fused_ops: bool = False,
        compiled: bool = False,
        max_model_len: int | None = None,
    ):
        """`max_model_len`: the longest context the engine serves (None: the model's); it picks
        LongRoPE's factors (engine/models/rotary.py)."""
        super().__init__()
        why = unsupported_because(config)
        if why is not None:
            raise UnsupportedArchitectureError(why)
        num_heads = config.num_attention_heads
        self.config = config
        rotaries, rope_tables = rotary_tables(config, max_model_len)
        switches = family_switches(config)
        self.shape = LlamaShape(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim_of(config),
            rms_norm_eps=config.rms_norm_eps,
            windows=layer_windows(config),
            rope_tables=rope_tables,
            switches=switches,
        )
        self.embed = weights.embedding("model.embed_tokens")
        self.layers = nn.ModuleList(
            LlamaLayer(self.shape, i, weights, f"model.layers.{i}.")
            for i in range(self.shape.num_layers)
        )
        norm = norm_weight(weights, "model.norm.weight", switches.norm_offset)
        if norm is None:
            raise ValueError("model.norm.weight is missing from the weights")
        self.norm = norm
        # Tied embeddings (SmolLM2, Llama 3.2, Qwen3 small): the head multiplies by the table.
        tied = getattr(config, "tie_word_embeddings", False) or not weights.has("lm_head.weight")
        self.lm_head = weights.linear(["model.embed_tokens" if tied else "lm_head"])
        # Built on the CPU like any new module: moved to where the weights are (a GPU's).
        self.rotaries = nn.ModuleList(r.to(self.norm.device) for r in rotaries)
        self.dtype = weights.dtype
        # Gemma: embeddings times sqrt(hidden) in the model's dtype, as transformers rounds it
        # (a float32 scalar, then cast).
        scale = switches.embed_scale
        self.embed_scale: torch.Tensor | None
        self.register_buffer(
            "embed_scale",
            None if scale is None else torch.tensor(scale).to(self.norm.device, self.dtype),
            persistent=False,
        )
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
            if self.embed_scale is not None:
                x = x * self.embed_scale
            angles = [rotary.angles(pos, x.dtype) for rotary in self.rotaries]
            lora = metadata.adapters
            if self.fused_ops:
                flat = [(cos.squeeze(1), sin.squeeze(1)) for cos, sin in angles]
                x = self._layers_fused(x, flat, metadata, kv_cache, lora)
            else:
                for layer in self.layers:
                    x = layer(x, *angles[layer.rope], metadata, kv_cache, self.steps, lora)
            rows = metadata.logits_indices
            if hidden_rows is None:
                return self._logits(rms_norm(x[rows], self.norm, self.shape.rms_norm_eps))
            # One final norm over both sets of rows (row-wise: each row as it would be alone).
            x = rms_norm(x[torch.cat((rows, hidden_rows))], self.norm, self.shape.rms_norm_eps)
            return self._logits(x[: rows.numel()]), x[rows.numel() :]

    def lora_targets(self) -> LoraTargets:
        """The projections a LoRA adapter of this model must match (engine/lora/)."""
        s = self.shape
        q_out, kv_out, _ = s.qkv_sizes
        return LoraTargets.llama(
            s.num_layers,
            s.hidden_size,
            q_out,
            kv_out,
            self.config.intermediate_size,
            self.dtype,
            self.norm.device,
            kernel=self.fused_ops,
        )

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        cap = self.shape.switches.final_softcap
        if cap is not None:  # Gemma's final softcap, as transformers applies it
            logits = torch.tanh(logits / cap) * cap
        return logits

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
        angles: list[tuple[torch.Tensor, torch.Tensor]],  # per rotary table: cos, sin [T, width]
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
        lora: StepAdapters | None,
    ) -> torch.Tensor:
        """Every layer through the jitney:: ops; each residual add is fused with the norm that
        follows it (the next layer's input norm, across layers), x updated in place. A
        decode-only step runs them as one jitney::llama_decode_layers_ call: the same ops, in
        the same order, without Python between them."""
        ops, s = torch.ops.jitney, self.shape
        eps = s.rms_norm_eps
        x = x.contiguous()
        if self._decode_layers is not None and _decode_only(meta, kv_cache, x.shape[0]):
            tensors, matrices, out_norms = self._decode_layers
            lora_rows, lora_packs = lora.decode_arguments() if lora else ([], [])
            group = meta.decodes[0]
            ops.llama_decode_layers_(
                x,
                tensors,
                matrices,
                [cos for cos, _ in angles],
                [sin for _, sin in angles],
                meta.slot_mapping,
                kv_cache.pool,
                group.blocks.view(-1, group.num_blocks),
                meta.decode_ctx[group.members],
                s.num_heads,
                s.num_kv_heads,
                eps,
                [w or 0 for w in s.windows],
                list(s.rope_tables),
                out_norms,
                s.switches.attention_scale,
                s.switches.activation_kind,
                lora_rows,
                lora_packs,
            )
            return x
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            cos, sin = angles[layer.rope]
            h = ops.add_rms_norm_(
                x, layer.attention_fused(h, cos, sin, meta, kv_cache, lora), layer.post_norm, eps
            )
            r = layer.mlp_fused(h, lora)
            if i + 1 < len(self.layers):
                h = ops.add_rms_norm_(x, r, self.layers[i + 1].input_norm, eps)
            else:
                x.add_(r)
        return x

    @classmethod
    def from_transformers(
        cls, model: nn.Module, compiled: bool = False, max_model_len: int | None = None
    ) -> LlamaForward:
        """The same weights as a loaded transformers model, in its dtype, held once: the fused
        projections are new tensors, and the transformers model's own Q/K/V and gate/up
        parameters become views of them (same values), so the reference still runs."""
        weights = StateDictWeights(dict(model.named_parameters()), share=True)
        return cls(model.config, weights, compiled=compiled, max_model_len=max_model_len)


def _decode_only(meta: AttentionMetadata, kv_cache: PagedKVCache, num_tokens: int) -> bool:
    """Whether every row of the step is one sequence's next token, all attending in place
    through the native kernel in one group, in row order."""
    if kv_cache.decode_kernel != "native" or meta.prefills or len(meta.decodes) != 1:
        return False
    return meta.decodes[0].rows == slice(0, num_tokens)


def _decode_layer_tensors(
    layers: Sequence[LlamaLayer],
) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]] | None:
    """llama_decode_layers_'s `tensors`, `matrices` and `out_norms` (engine/kernels/reference.py
    says the order), or None where some projection is not a quantized layer."""
    empty = torch.empty(0)
    tensors: list[torch.Tensor] = []
    matrices: list[int] = []
    out_norms: list[torch.Tensor] = []
    for layer in layers:
        if layer.attn_out_norm is not None and layer.mlp_out_norm is not None:
            out_norms += [layer.attn_out_norm, layer.mlp_out_norm]
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
    return tensors, matrices, out_norms
