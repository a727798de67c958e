"""The fleet's runtime LoRA adapters: one Redis hash per base model (`Keys.lora_adapters`),
adapter name -> `RegisteredAdapter` as JSON.

Gateways write it (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) and list what it holds
in /v1/models; every worker of the model polls it and loads or drops adapters to match, so a
worker started later loads them all (worker/adapter_watch.py). The adapters given with
`--lora-modules` are not in it: a worker's model card names those.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class RegisteredAdapter:
    path: str  # as the gateway resolved it under --lora-root (symlinks resolved)
    added: float = field(default_factory=time.time)  # unix seconds

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def read_registry(fields: dict[Any, Any]) -> dict[str, RegisteredAdapter]:
    """An HGETALL of the hash, name -> adapter; an entry that is not one is left out (a
    writer of another version, a hand-made HSET): it is nobody's to serve."""
    adapters: dict[str, RegisteredAdapter] = {}
    for raw_name, raw in fields.items():
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        try:
            data = json.loads(raw)
            path, added = data["path"], data.get("added", 0.0)
        except (ValueError, TypeError, KeyError):
            continue
        if isinstance(path, str) and path and isinstance(added, int | float):
            adapters[name] = RegisteredAdapter(path, float(added))
    return adapters
