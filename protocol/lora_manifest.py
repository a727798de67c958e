"""What a LoRA adapter's files must hold to be served, read without torch: the contract between
the gateway that accepts an adapter (POST /v1/load_lora_adapter) and the workers that load it.

A PEFT directory's `adapter_config.json` (a LoRA adapter without DoRA, `modules_to_save`,
`fan_in_fan_out` or trained biases) and the tensor names in its safetensors header, each one of
the covered projections; a GGUF adapter's magic. The engine's reader (engine/lora/adapter_files.py)
applies the same rules to what it loads; the gateway checks them first, so an adapter a worker
would refuse is refused to the caller, by name, instead of in a worker's log.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

# The projections an adapter may target: PEFT's module name -> llama.cpp's tensor name.
PROJECTIONS = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "qkv_proj": "attn_qkv",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "gate_up_proj": "ffn_up",  # Phi-3 stores its fused gate/up under llama.cpp's ffn_up
    "down_proj": "ffn_down",
}
_PEFT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# A safetensors header's length is a little-endian u64; past this it is not an adapter's.
_MAX_HEADER_BYTES = 64 << 20


def peft_key(key: str) -> tuple[int, str, str] | None:
    """(layer, module, "A" or "B") of a PEFT tensor key of a covered projection; None for any
    other key."""
    match = _PEFT_KEY.search(key)
    if match is None or match.group(2) not in PROJECTIONS:
        return None
    return int(match.group(1)), match.group(2), match.group(3)


def uncovered(key: str) -> str:
    """Why tensor `key` cannot be served: the module it belongs to, named."""
    name = key.removeprefix("base_model.model.")
    module = re.sub(r"\.(base_layer|lora_\w+|weight|bias)(\.\w+)*$", "", name) or key
    return f"{module!r} is not a module Jitney's adapters cover (covered: {', '.join(PROJECTIONS)})"


def peft_config_problem(config: Any) -> str | None:
    """What in an `adapter_config.json` Jitney cannot serve (None: nothing)."""
    if not isinstance(config, dict):
        return "adapter_config.json is not an object"
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        return f"a {kind} adapter, not a LoRA one"
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    }
    for field, what in refused.items():
        if config.get(field):
            return f"{what} is not supported ({field} = {config[field]!r})"
    if config.get("bias", "none") != "none":
        return f"trained biases are not supported (bias = {config['bias']!r})"
    return None


def manifest_problem(path: Path) -> str | None:
    """What makes the adapter at `path` one no worker would serve (None: nothing found; a
    worker still reads the weights, and their shapes against its model, when it loads it)."""
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        return None if magic == b"GGUF" else "not a GGUF file (nor a PEFT directory)"
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return "no readable adapter_config.json (a PEFT directory has one)"
    problem = peft_config_problem(config)
    if problem is not None:
        return problem
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        legacy = (path / "adapter_model.bin").is_file()
        return None if legacy else "no adapter_model.safetensors (or .bin)"
    try:
        names = safetensors_names(weights)
    except (OSError, ValueError) as e:
        return f"unreadable adapter_model.safetensors ({e})"
    bad = next((n for n in names if peft_key(n) is None), None)
    if bad is not None:
        return uncovered(bad)
    return None if names else "adapter_model.safetensors holds no LoRA weights"


def safetensors_names(file: Path) -> list[str]:
    """The tensor names of a safetensors file, from its JSON header alone."""
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER_BYTES:
            raise ValueError("its header is too large for an adapter's")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return [name for name in header if name != "__metadata__"]
