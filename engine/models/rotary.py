"""Rotary position embeddings for Jitney's forward: one table per RoPE parameter set a model
uses, and which table each layer reads.

A table is computed as transformers computes it (position * inv_freq in float32, both halves,
times the attention factor), so the rotation is the reference's bit for bit; cos/sin are made
once per step for the step's positions and shared by every layer that reads the table: no
table of positions, so any context length costs the same. A table's width is the rotated part
of a head: all of it, Phi's `partial_rotary_factor` of it, or none (SmolLM3's layers without
RoPE read an empty table; the rotation ops rotate the first `width` elements of each head).

LongRoPE (Phi-3/Phi-4 long-context configs) multiplies the wavelengths by per-dimension
factors, short ones or long ones. transformers picks them per forward call from the call's
longest position (beyond `original_max_position_embeddings`: long), which a paged cache cannot
follow: its K are stored already rotated, so a sequence crossing the boundary would attend
keys rotated under the other factors. Jitney picks once, at start, as vLLM does: long factors
when the context the engine serves (`--max-model-len`, else the model's
`max_position_embeddings`) exceeds `original_max_position_embeddings`, short ones otherwise.
Up to that length every position is rotated as transformers rotates it; with long factors,
prompts shorter than the original length are rotated as transformers would rotate them inside
a longer sequence (and as the long factors were trained), not as it rotates a short call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.models.families import head_dim_of, layer_uses_rope, rope_parameter_sets


class Rotary(nn.Module):
    """One RoPE table: inverse frequencies (float32) and the attention factor on cos/sin."""

    def __init__(self, inv_freq: torch.Tensor, factor: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.factor = float(factor)

    @property
    def width(self) -> int:
        """How many elements of each head this table rotates."""
        return 2 * self.inv_freq.numel()

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(cos, sin), each [T, 1, width], for positions [T]."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def longrope_uses_long_factors(config: Any, max_model_len: int | None) -> bool | None:
    """Whether a LongRoPE model runs on its long factors (None: the model is not LongRoPE)."""
    for params in rope_parameter_sets(config).values():
        if params.get("rope_type") == "longrope":
            original = _original_max_len(config, params)
            return (max_model_len or config.max_position_embeddings) > original
    return None


def rotary_tables(
    config: Any, max_model_len: int | None = None
) -> tuple[list[Rotary], tuple[int, ...]]:
    """The model's RoPE tables, and per layer the index of the one it reads."""
    sets = rope_parameter_sets(config)
    tables = [_table(config, kind, params, max_model_len) for kind, params in sets.items()]
    if None in sets:  # one table for every layer
        index = [0] * config.num_hidden_layers
    else:  # a table per layer type (Gemma 3)
        index = [list(sets).index(t) for t in config.layer_types]
    uses_rope = layer_uses_rope(config)
    if not all(uses_rope):
        tables.append(Rotary(torch.empty(0)))  # the layers without RoPE: nothing rotated
        index = [i if rope else len(tables) - 1 for i, rope in zip(index, uses_rope, strict=True)]
    return tables, tuple(index)


def _original_max_len(config: Any, params: Mapping[str, Any]) -> int:
    original = params.get("original_max_position_embeddings")
    original = original or getattr(config, "original_max_position_embeddings", None)
    return original or config.max_position_embeddings


def _table(
    config: Any, layer_type: str | None, params: Mapping[str, Any], max_model_len: int | None
) -> Rotary:
    rope_type = params.get("rope_type", "default")
    per_type = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "default":
        dim = int(head_dim_of(config) * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        return Rotary(1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)))
    if rope_type == "longrope":
        # transformers' long factors apply from one position past the original length.
        long = longrope_uses_long_factors(config, max_model_len)
        seq_len = _original_max_len(config, params) + 1 if long else None
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len, **per_type)
        return Rotary(inv_freq, factor)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, **per_type)
    return Rotary(inv_freq, factor)
