"""The LoRA flags (vLLM's): `--lora-modules name=path ...`, `--max-loras`, `--max-lora-rank`.

Each `--lora-modules` item is `name=path` or vLLM's JSON object `{"name": ..., "path": ...}`
(its `base_model_name` is accepted and ignored: the base is the worker's model). A malformed item
is an argparse error, so it is refused before torch loads.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, NamedTuple

from jitney.commands.flag_types import positive_int

# vLLM's JSON item's keys; anything else is refused by name rather than dropped.
JSON_KEYS = frozenset({"name", "path", "base_model_name"})


class LoraModule(NamedTuple):
    """One adapter served beside the model; the flag's own form when written back (`jitney
    up` passes it on to its workers)."""

    name: str
    path: str

    def __str__(self) -> str:
        return f"{self.name}={self.path}"


def lora_module(text: str) -> LoraModule:
    """`--lora-modules`' type: one item, `name=path` or a JSON object."""
    if text.lstrip().startswith("{"):
        return _from_json(text)
    name, sep, path = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(  # a prompt of `jitney generate` after the items too
            f"{text!r} is not name=path (or a JSON object with name and path); the flag takes "
            "every word up to the next flag or `--`"
        )
    return _checked(name.strip(), path.strip())


def _from_json(text: str) -> LoraModule:
    try:
        item: Any = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
    if not isinstance(item, dict):
        raise argparse.ArgumentTypeError("a JSON item must be an object with name and path")
    unknown = sorted(set(item) - JSON_KEYS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key(s) {', '.join(map(repr, unknown))}")
    name, path = item.get("name"), item.get("path")
    if not isinstance(name, str) or not isinstance(path, str):
        raise argparse.ArgumentTypeError("a JSON item needs string fields name and path")
    return _checked(name.strip(), path.strip())


def _checked(name: str, path: str) -> LoraModule:
    if not name or not path:
        raise argparse.ArgumentTypeError("an adapter needs both a name and a path")
    if "=" in name or any(c.isspace() for c in name):
        raise argparse.ArgumentTypeError(f"adapter name {name!r} holds '=' or whitespace")
    return LoraModule(name, path)


def add_lora_arguments(g: argparse._ArgumentGroup, defaults: dict[str, object]) -> None:
    """Into the engine's flag group; `defaults`: EngineConfig's fields."""
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=defaults["lora_modules"],
        metavar="NAME=PATH",
        help="LoRA adapters served beside the model, each chosen by a request's `model`: "
        'name=path or vLLM\'s JSON {"name": ..., "path": ...}; a PEFT adapter directory '
        "(adapter_config.json + adapter_model.safetensors) or a llama.cpp GGUF adapter",
    )
    g.add_argument(
        "--max-loras",
        type=positive_int,
        default=defaults["max_loras"],
        metavar="N",
        help="adapters resident at once (the least recently used one no running request uses "
        "makes room)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=positive_int,
        default=defaults["max_lora_rank"],
        metavar="R",
        help="the largest adapter rank accepted (a higher one is refused at load)",
    )


def lora_fields(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig's LoRA fields from the flags; a name given twice is refused (ValueError)."""
    modules = tuple(LoraModule(*m) for m in args.lora_modules or ())
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {', '.join(map(repr, twice))} more than once")
    return {
        "lora_modules": tuple((m.name, m.path) for m in modules),
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
    }
