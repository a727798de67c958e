"""vLLM's `--speculative-config` JSON, read into the engine's own speculation settings.

vLLM (0.8 on) takes speculative decoding as one JSON object, `--speculative-config
'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'`, where Jitney has
one flag a setting. A deployment moving over keeps its object: each key it shares with Jitney
sets the matching flag's setting (named flat, as the flags are: engine/speculative_options.py
FLAT_FIELDS), and anything else is refused by name, never dropped, so a setting the user relies
on cannot silently stop applying. Pure: no torch, read with the flags.
"""

from __future__ import annotations

import json
from typing import Any

# Key -> the setting it sets, by its flat name (the same value, the same meaning).
INT_KEYS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}
# vLLM's methods Jitney runs, and the `speculative` mode each is.
METHODS = {"ngram": "ngram", "draft_model": "draft"}
# vLLM's `"model": "ngram"` (or "[ngram]") meant prompt lookup before `method` existed.
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
# Keys accepted at the one value that matches what Jitney does anyway.
NEUTRAL_KEYS = {"draft_tensor_parallel_size": 1}
KEYS = ("method", "model", *INT_KEYS, *NEUTRAL_KEYS)
# The settings an object can set, by flat name (each flag of these notes when it is given).
FIELDS = ("speculative", "speculative_model", *INT_KEYS.values())


def speculative_config_fields(text: str) -> dict[str, Any]:
    """The settings a `--speculative-config` object sets, by flat name (EngineConfig.from_flat
    takes them); ValueError, naming the key, for anything Jitney cannot honour."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: unsupported key(s) {', '.join(unknown)}; Jitney reads "
            f"{', '.join(KEYS)}"
        )
    fields: dict[str, Any] = {"speculative": _mode(config)}
    model = config.get("model")
    if fields["speculative"] == "draft":
        fields["speculative_model"] = model
    for key, field in INT_KEYS.items():
        if key in config:
            fields[field] = _int(key, config[key])
    for key, value in NEUTRAL_KEYS.items():
        if key in config and config[key] != value:
            raise ValueError(
                f"--speculative-config: {key} must be {value} (Jitney runs the draft model in "
                f"the worker's own process), got {config[key]!r}"
            )
    return fields


def _mode(config: dict[str, Any]) -> str:
    """The `speculative` mode: the method's, or, without one, what `model` implies."""
    method, model = config.get("method"), config.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"--speculative-config: model must be a model name, got {model!r}")
    if method is None:
        if model is None:
            raise ValueError("--speculative-config needs a method (ngram, draft_model) or a model")
        return "ngram" if model in NGRAM_MODEL_NAMES else "draft"
    if method not in METHODS:
        raise ValueError(
            f"--speculative-config: method {method!r} is not supported; Jitney proposes with "
            f"{' or '.join(METHODS)} (its ngram also looks up the worker's earlier replies, "
            "as suffix decoding does: --speculative-history-tokens)"
        )
    mode = METHODS[method]
    if mode == "draft" and model is None:
        raise ValueError("--speculative-config: method draft_model needs a model")
    if mode == "ngram" and model is not None and model not in NGRAM_MODEL_NAMES:
        raise ValueError(
            f"--speculative-config: method ngram takes no model, got {model!r} (a draft "
            "model's method is draft_model)"
        )
    return mode


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
    return value
