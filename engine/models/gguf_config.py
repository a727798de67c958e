"""A GGUF file's transformers config, read from its metadata as llama.cpp's converter wrote it.

A GGUF carries no config.json: its metadata is the config, under llama.cpp's key names
(`{arch}.block_count`, `{arch}.attention.head_count_kv`, ...). `gguf_config` turns it into the
config the architecture's transformers class (LlamaConfig, Gemma3TextConfig, Phi3Config, ...)
would make of it, field for field, without importing that class (`FamilyConfig`: the import
costs a start 0.4-1.2 s). That is what Jitney's forward is built from. Building a config is
cheap; no model is.

Where the converter stated a thing as a tensor or left it to llama.cpp's defaults, the config
says it the way transformers does:
- Gemma 3: the sliding window on every layer but each sixth (llama.cpp's default pattern unless
  the file states one), RoPE base 10,000 on sliding layers unless stated, the query scaled by
  1/sqrt(head_dim) (by hidden/heads on the 62-layer model, as llama.cpp does);
- Phi-3: a rotary width below the head's (`rope.dimension_count`) is a partial rotary factor;
  LongRoPE's factors are the `rope_factors_long/short` tensors;
- SmolLM3: every fourth layer without RoPE (llama.cpp's fixed step);
- Llama 3.x: the `rope_freqs` tensor is the "llama3" RoPE the converter computed from the
  config; it is matched against that computation with Llama 3's low/high frequency factors
  and original context (1, 4, 8192), and refused if it does not match.
An architecture not listed in GGUF_MODEL_TYPES raises UndescribedGGUFError (the loader then
falls back to transformers' own GGUF conversion).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from transformers import PretrainedConfig

from engine.models.gguf_index import GGUFIndex

# general.architecture -> transformers model_type, for the architectures described here.
GGUF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "smollm3": "smollm3",
}
_REQUIRED = object()
# Llama 3.x's llama3 RoPE, as its configs state it (the factor is read from the tensor).
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_CONTEXT = 1.0, 4.0, 8192
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's: each sixth layer attends globally
# A per-layer list where the file states one (read_gguf_index must be asked for it).
GEMMA3_PATTERN_KEY = "gemma3.attention.sliding_window_pattern"
CONFIG_ARRAYS = (GEMMA3_PATTERN_KEY,)
SMOLLM3_NO_ROPE_STEP = 4


# Each described family's defaults, as its transformers 5 config class states them (the test
# compares every field with the class's), so that a GGUF's config imports no model package:
# the first import under transformers.models indexes every model's source (0.4 s of a start),
# and LlamaConfig's module pulls torch.distributed.tensor in (0.8 s more).
_COMMON = {"attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}
_SILU = _COMMON | {"hidden_act": "silu"}
_QWEN = _SILU | {"max_window_layers": 28, "sliding_window": None, "use_sliding_window": False}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _SILU | {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    "qwen2": _QWEN,
    "qwen3": _QWEN | {"attention_bias": False},
    "gemma3_text": _COMMON
    | {
        "_sliding_window_pattern": GEMMA3_SLIDING_PATTERN,
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "use_bidirectional_attention": False,
    },
    "phi3": _SILU | {"embd_pdrop": 0.0, "resid_pdrop": 0.0},
    "smollm3": _SILU
    | {"attention_bias": False, "mlp_bias": False, "sliding_window": None}
    | {"use_sliding_window": False},
}
# Families whose class states every layer's attention (all full: none of these slides here).
_FULL_LAYER_TYPES = ("qwen2", "qwen3", "smollm3")


class FamilyConfig(PretrainedConfig):
    """A described family's config without its class: the file's fields over the family's
    defaults (FAMILY_DEFAULTS). Only Jitney's forward reads it; the exact mode and the
    transformers fallback build their models from a converted checkpoint's own config.json."""

    def __init__(self, **fields: Any):
        # The defaults as attributes first: PretrainedConfig's __init__ drops some it is given
        # (use_cache), as the family classes' own fields are not.
        for name, value in FAMILY_DEFAULTS[self.model_type].items():
            setattr(self, name, fields.pop(name, value))
        if self.model_type in _FULL_LAYER_TYPES and fields.get("layer_types") is None:
            fields["layer_types"] = ["full_attention"] * fields["num_hidden_layers"]
        super().__init__(**fields)


@cache
def family_config_class(model_type: str) -> type[FamilyConfig]:
    """FamilyConfig for `model_type` (a class attribute in transformers' configs). Its own
    __init__ in its namespace: transformers wraps a config class without one in an __init__ of
    its own, which would not call FamilyConfig's."""
    name = f"{model_type.title().replace('_', '')}Fields"
    namespace = {"model_type": model_type, "__init__": FamilyConfig.__init__}
    return type(name, (FamilyConfig,), namespace)


class UndescribedGGUFError(ValueError):
    """A GGUF whose architecture (or a part of it) gguf_config cannot state as a config."""


class _Metadata:
    """The file's metadata under its architecture's prefix, with clear errors."""

    def __init__(self, index: GGUFIndex):
        self.index = index
        self.values = index.metadata
        arch = self.values.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError("GGUF file has no general.architecture")
        self.arch = arch
        self.tensors = {t.name: t for t in index.tensors}

    def __call__(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.values.get(f"{self.arch}.{key}", default)
        if value is _REQUIRED:
            raise ValueError(f"GGUF file ({self.arch}) has no {self.arch}.{key}")
        return value

    def tensor_values(self, name: str) -> list[float]:
        from gguf.quants import dequantize

        info = self.tensors[name]
        return [float(v) for v in np.asarray(dequantize(info.data, info.qtype)).reshape(-1)]


def gguf_config(index: GGUFIndex) -> PretrainedConfig:
    """The transformers config the file's metadata states."""
    model_type, fields = gguf_config_fields(index)
    return family_config_class(model_type)(**fields)


def gguf_config_fields(index: GGUFIndex) -> tuple[str, dict[str, Any]]:
    """The model_type and the config's fields the file's metadata states."""
    key = _Metadata(index)
    model_type = GGUF_MODEL_TYPES.get(key.arch)
    if model_type is None:
        raise UndescribedGGUFError(
            f"GGUF architecture {key.arch!r} is not described here "
            f"(described: {', '.join(GGUF_MODEL_TYPES)})"
        )
    hidden, heads = key("embedding_length"), key("attention.head_count")
    embed = key.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError("GGUF file has no token_embd.weight")
    head_dim = key("attention.key_length", None) or hidden // heads
    if key.arch in ("llama", "smollm3"):  # the converter writes the head's width here
        head_dim = key("attention.key_length", None) or key("rope.dimension_count", head_dim)
    fields: dict[str, Any] = {
        "vocab_size": embed.dims[1],  # the table's rows: what the logits are as wide as
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        # llama.cpp writes the output projection only when it is not the embedding table.
        "tie_word_embeddings": "output.weight" not in key.tensors,
        "bos_token_id": index.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": index.metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": index.metadata.get("tokenizer.ggml.padding_token_id"),
        "rope_parameters": _rope_parameters(key, head_dim),
    }
    _ARCH_FIELDS.get(key.arch, lambda key, fields: None)(key, fields)
    if "attention_bias" in FAMILY_DEFAULTS[model_type]:  # the class has the switch
        fields["attention_bias"] = "blk.0.attn_q.bias" in key.tensors
    return model_type, fields


def _rope_parameters(key: _Metadata, head_dim: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": key("rope.freq_base", 1e4)}
    scaling = key("rope.scaling.type", "none")
    factor = key("rope.scaling.factor", None)
    if scaling == "linear" and factor:
        params |= {"rope_type": "linear", "factor": factor}
    elif scaling == "yarn" and factor:
        params |= {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": key("rope.scaling.original_context_length"),
        }
        for gguf_key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := key(f"rope.scaling.{gguf_key}", None)) is not None:
                params[name] = value
    elif scaling not in ("none", "longrope"):  # longrope: Phi-3's, from its tensors
        raise UndescribedGGUFError(f"GGUF RoPE scaling {scaling!r} is not described here")
    if "rope_freqs.weight" in key.tensors:
        params = _llama3_rope(key.tensor_values("rope_freqs.weight"), params, head_dim)
    return params


def _llama3_rope(file_factors: list[float], params: dict[str, Any], head_dim: int) -> dict:
    """The llama3 RoPE whose per-frequency divisors the converter wrote as `rope_freqs`."""
    theta, factor = params["rope_theta"], max(file_factors)
    llama3 = params | {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": _LLAMA3_LOW,
        "high_freq_factor": _LLAMA3_HIGH,
        "original_max_position_embeddings": _LLAMA3_CONTEXT,
    }
    low_wavelen, high_wavelen = _LLAMA3_CONTEXT / _LLAMA3_LOW, _LLAMA3_CONTEXT / _LLAMA3_HIGH
    expected = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            expected.append(1.0)
        elif wavelen > low_wavelen:
            expected.append(factor)
        else:
            smooth = (_LLAMA3_CONTEXT / wavelen - _LLAMA3_LOW) / (_LLAMA3_HIGH - _LLAMA3_LOW)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if len(expected) != len(file_factors) or not np.allclose(expected, file_factors, rtol=1e-4):
        raise UndescribedGGUFError("GGUF rope_freqs tensor is not Llama 3's llama3 RoPE")
    return llama3


def _gemma3_fields(key: _Metadata, fields: dict[str, Any]) -> None:
    layers, window = fields["num_hidden_layers"], key("attention.sliding_window", 0)
    pattern = key.index.arrays.get(GEMMA3_PATTERN_KEY)
    if pattern is None:  # a count (or llama.cpp's default): every n-th layer is global
        n = key("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        pattern = [n == 0 or i % n < n - 1 for i in range(layers)]
    sliding = bool(window) and any(pattern)
    full = dict(fields["rope_parameters"])
    local = {"rope_type": "default", "rope_theta": key("rope.freq_base_swa", 1e4)}
    fields |= {
        "layer_types": [
            "sliding_attention" if sliding and pattern[i] else "full_attention"
            for i in range(layers)
        ],
        "sliding_window": window or None,
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        # llama.cpp's scale: 1/sqrt(head_dim), but hidden/heads on the 27B model (62 layers).
        "query_pre_attn_scalar": (
            fields["hidden_size"] // fields["num_attention_heads"]
            if layers == 62
            else fields["head_dim"]
        ),
        "final_logit_softcapping": key("final_logit_softcapping", None),
    }


def _phi3_fields(key: _Metadata, fields: dict[str, Any]) -> None:
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    rotary = key("rope.dimension_count", head_dim)
    rope = fields["rope_parameters"] | {"partial_rotary_factor": rotary / head_dim}
    original = key("rope.scaling.original_context_length", fields["max_position_embeddings"])
    if "rope_factors_long.weight" in key.tensors:
        rope |= {
            "rope_type": "longrope",
            "long_factor": key.tensor_values("rope_factors_long.weight"),
            "short_factor": key.tensor_values("rope_factors_short.weight"),
            "original_max_position_embeddings": original,
        }
    fields |= {
        "head_dim": head_dim,
        "rope_parameters": rope,
        "original_max_position_embeddings": original,
        "sliding_window": key("attention.sliding_window", 0) or None,
    }


def _smollm3_fields(key: _Metadata, fields: dict[str, Any]) -> None:
    layers = fields["num_hidden_layers"]
    fields["no_rope_layers"] = [int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(layers)]
    fields["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_STEP


_ARCH_FIELDS: dict[str, Callable[[_Metadata, dict[str, Any]], None]] = {
    "gemma3": _gemma3_fields,
    "phi3": _phi3_fields,
    "smollm3": _smollm3_fields,
}
