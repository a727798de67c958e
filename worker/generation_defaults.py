"""The sampling defaults a worker publishes in its model card (protocol.sampling_defaults), from
`--generation-config` and `--override-generation-config`, as vLLM's flags of the same names:

- `auto` (the default): the model's generation_config.json sampling keys, and for the bundled
  SmolLM2 its authors' values (engine.models.model_loader.SMOLLM2_RECOMMENDED_SAMPLING);
- `vllm`: none, the API's own defaults;
- a directory: the sampling keys of the generation_config.json in it.

The override's keys win over the file's. Keys are generation_config.json's names; a file's other
keys (eos_token_id, ...) are not sampling and are passed over, an override's are refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protocol.sampling_defaults import SamplingDefaults

logger = logging.getLogger("jitney.worker")

AUTO, VLLM = "auto", "vllm"
# generation_config.json's sampling keys and the API field each sets the default of.
API_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# Sampling keys vLLM reads that Jitney's sampler has no counterpart for: a file's are passed
# over with a warning, an override's refused (a default that would do nothing).
UNSUPPORTED = frozenset({"min_p"})


def check_choice(choice: str) -> None:
    """`--generation-config` is auto, vllm or a directory holding a generation_config.json
    (checked before the model loads; the file's values are read after)."""
    if choice in (AUTO, VLLM):
        return
    if not (Path(choice).expanduser() / "generation_config.json").is_file():
        raise ValueError(
            f"--generation-config must be {AUTO}, {VLLM} or a directory holding a "
            f"generation_config.json, got {choice!r}"
        )


def parse_override(text: str) -> SamplingDefaults:
    """`--override-generation-config`'s JSON object (empty: none)."""
    if not text.strip():
        return SamplingDefaults()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"--override-generation-config must be a JSON object, got {type(data).__name__}"
        )
    unknown = sorted(set(data) - API_FIELDS.keys())
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown or unsupported key(s) {', '.join(unknown)}; "
            f"known: {', '.join(API_FIELDS)}"
        )
    return _defaults(data, "--override-generation-config")


def from_generation_config(config: Mapping[str, Any], origin: str) -> SamplingDefaults:
    """The sampling keys of a generation_config.json (`origin` names it in errors); null is
    absent, as transformers writes it."""
    for key in sorted(UNSUPPORTED & config.keys()):
        if config[key] not in (None, 0, 0.0):
            logger.warning(
                "generation_config_key_ignored key=%s value=%s origin=%s (no such sampler "
                "option in Jitney)",
                key,
                config[key],
                origin,
            )
    return _defaults({k: v for k, v in config.items() if k in API_FIELDS}, origin)


def resolve(
    choice: str, override: SamplingDefaults, model_config: Mapping[str, Any]
) -> SamplingDefaults:
    """The defaults in force: the chosen source's, then the override's on top.
    `model_config`: the loaded model's (engine.models.model_loader.LoadedModel)."""
    from engine.models.model_loader import read_generation_config  # torch: only once loaded

    if choice == AUTO:
        base = from_generation_config(model_config, "the model's generation_config.json")
    elif choice == VLLM:
        base = SamplingDefaults()
    else:
        path = Path(choice).expanduser() / "generation_config.json"
        base = from_generation_config(read_generation_config(choice), str(path))
    return base.updated(override)


def _defaults(data: Mapping[str, Any], origin: str) -> SamplingDefaults:
    values = {API_FIELDS[k]: v for k, v in data.items() if v is not None}
    if values.get("top_k") == -1:  # vLLM's "off", as 0 is transformers'
        values["top_k"] = 0
    try:
        return SamplingDefaults(**values)
    except ValueError as e:  # in the file's own names
        raise ValueError(f"{origin}: {str(e).replace('max_tokens', 'max_new_tokens')}") from None
