"""The model families Jitney's forward covers, each read off its transformers config as the Llama
decoder layer (engine/models/llama_layer.py) with a shape and a few switches.

Llama, Qwen2, Qwen3 and Mistral are the plain layer (Qwen3 adds per-head Q/K norms, found by
their weights). Gemma 3 (text) sets every switch: norms multiply by (1 + w), the attention's and
the MLP's outputs are normed before their residual adds, a GELU-tanh gate, embeddings scaled by
sqrt(hidden), `query_pre_attn_scalar`, sliding layers with their own RoPE base, and a final
logit softcap where its config sets one. Phi-3 / Phi-4-mini rotate only part of each head
(`partial_rotary_factor`), store Q/K/V and gate/up fused (the layer asks its weight source for
whichever names exist) and may use LongRoPE (engine/models/rotary.py). SmolLM3 leaves RoPE off
every fourth layer (`no_rope_layers`). Per layer, the shape holds the sliding window and which
rotary table applies (engine/models/rotary.py); what is the same for every layer is here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# transformers model_type values the forward covers (each checked against its transformers model
# in tests/engine/test_llama_forward.py and tests/engine/test_model_families.py).
COVERED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "smollm3")
# The MLP's gate: index = the decode op's `activation` argument (engine/kernels/ops.py).
ACTIVATIONS = ("silu", "gelu_tanh")
_ACTIVATION_OF = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# RoPE variants Jitney's forward computes. "longrope" picks its short or long factors once, at
# start (engine/models/rotary.py); "dynamic" rescales with every step's length (not covered:
# auto falls back to transformers).
COVERED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_PARTIAL_ROTARY = ("phi3",)  # the families whose transformers model honours the factor


class UnsupportedArchitectureError(ValueError):
    """A model Jitney's own forward does not cover (`--model-impl jitney` refuses it)."""


@dataclass(frozen=True, slots=True)
class FamilySwitches:
    """What a family changes in the Llama layer, the same for every layer."""

    attention_scale: float  # the scores' scale: head_dim ** -0.5, Gemma's query_pre_attn_scalar
    norm_offset: float = 0.0  # Gemma 1.0: each RMSNorm multiplies by (1 + w), held in float32
    output_norms: bool = False  # Gemma: attention and MLP outputs normed before the residual add
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # Gemma: sqrt(hidden), applied in the model's dtype
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    @property
    def activation_kind(self) -> int:
        return ACTIVATIONS.index(self.activation)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def activation_name(config: Any) -> str:
    """The transformers name of the MLP's activation (Gemma calls the field hidden_activation)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def family_switches(config: Any) -> FamilySwitches:
    """The switches of a covered config (unsupported_because said None)."""
    activation = _ACTIVATION_OF[activation_name(config)]
    if config.model_type == "gemma3_text":
        return FamilySwitches(
            attention_scale=config.query_pre_attn_scalar**-0.5,
            norm_offset=1.0,
            output_norms=True,
            activation=activation,
            embed_scale=config.hidden_size**0.5,
            final_softcap=config.final_logit_softcapping,
        )
    return FamilySwitches(attention_scale=head_dim_of(config) ** -0.5, activation=activation)


def rope_parameter_sets(config: Any) -> dict[str | None, Mapping[str, Any]]:
    """The config's RoPE parameters: per layer type where it keys them so (Gemma 3: sliding
    and full attention layers each with their own base), else one set under None."""
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None) or ()
    if layer_types and all(t in params for t in set(layer_types)):
        return {t: params[t] for t in sorted(set(layer_types))}
    return {None: params}


def unsupported_because(config: Any) -> str | None:
    """Why Jitney's forward cannot run a model of this transformers config (None: it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in COVERED_MODEL_TYPES:
        return f"architecture {model_type!r} is not covered (covered: {COVERED_MODEL_TYPES})"
    activation = activation_name(config)
    if activation not in _ACTIVATION_OF:
        return f"activation {activation!r} is not covered (covered: {tuple(_ACTIVATION_OF)})"
    for params in rope_parameter_sets(config).values():
        rope_type = params.get("rope_type", "default")
        if rope_type not in COVERED_ROPE_TYPES:
            return f"rope_type {rope_type!r} is not covered (covered: {COVERED_ROPE_TYPES})"
        partial = params.get("partial_rotary_factor", 1.0)
        if partial != 1.0 and model_type not in _PARTIAL_ROTARY:
            return f"partial_rotary_factor {partial} is not covered for {model_type!r}"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention is not covered (only causal)"
    return None


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window, as the family's transformers model applies it."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type in ("mistral", "phi3"):  # every layer slides when the config sets one
        return (window,) * num_layers
    if config.model_type == "smollm3" and not config.use_sliding_window:
        return (None,) * num_layers
    if layer_types is not None:  # Qwen2/Qwen3/Gemma 3/SmolLM3: "sliding_attention" layers slide
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * num_layers


def layer_uses_rope(config: Any) -> tuple[bool, ...]:
    """Per layer, whether RoPE turns its Q and K (SmolLM3's `no_rope_layers`: 1 = it does)."""
    flags = getattr(config, "no_rope_layers", None)
    if config.model_type != "smollm3" or flags is None:
        return (True,) * config.num_hidden_layers
    return tuple(bool(f) for f in flags)
