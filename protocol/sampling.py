"""The one sampling-parameters type: parsed by the gateway, carried as a dict, taken by the sampler.

Adding a field is one line here plus its use: the type check, `to_dict` and `from_dict` follow the
field's annotation. Ranges are checked once, in `__post_init__`, with a ValueError naming the field
(the worker turns it into an error reply; the gateway checks its own, stricter, limits first).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, fields
from typing import Any, get_args, get_origin, get_type_hints

_SEED_RANGE = range(-(2**63), 2**64)  # what a signed or unsigned 64-bit seed can be


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # None: the engine draws one when the request starts
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # False: the engine returns token ids only and leaves text and stop strings to the caller
    # (the gateway detokenizes what it serves, off the worker's step; vLLM has the same field).
    detokenize: bool = True

    def __post_init__(self) -> None:
        for name, annotation in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not _conforms(value, annotation):
                got = "" if isinstance(value, tuple) else f", got {type(value).__name__}"
                raise ValueError(f"{name} must be {_describe(annotation)}{got}")
            if annotation is float:  # JSON writes 1.0 as 1; keep one spelling
                object.__setattr__(self, name, float(value))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and self.seed not in _SEED_RANGE:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples become lists."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in fields(self)
        }

    @classmethod
    def from_dict(cls, data: object) -> SamplingParams:
        """The wire form back; unknown or ill-typed fields raise ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling must be an object, got {type(data).__name__}")
        unknown = sorted(map(str, data.keys() - _FIELD_TYPES.keys()))
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**{k: tuple(v) if _is_list_field(k, v) else v for k, v in data.items()})


def _is_list_field(name: str, value: object) -> bool:
    return isinstance(value, list) and get_origin(_FIELD_TYPES[name]) is tuple


def _conforms(value: object, annotation: Any) -> bool:
    """isinstance for the few annotations sampling fields use; bool is not an int here."""
    if isinstance(annotation, types.UnionType):
        return any(_conforms(value, a) for a in get_args(annotation))
    if get_origin(annotation) is tuple:  # tuple[X, ...]
        item = get_args(annotation)[0]
        return isinstance(value, tuple) and all(_conforms(v, item) for v in value)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", None: "null"}


def _describe(annotation: Any) -> str:
    """How a field's type reads on the wire: 'an integer or null', 'a list of strings'."""
    if isinstance(annotation, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(annotation))
    if get_origin(annotation) is tuple:
        return f"a list of {_describe(get_args(annotation)[0]).split()[-1]}s"
    return _NAMES[None if annotation is type(None) else annotation]


_FIELD_TYPES: dict[str, Any] = get_type_hints(SamplingParams)
