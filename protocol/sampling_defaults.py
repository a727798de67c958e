"""A model's own sampling defaults: what a request gets in the sampling fields it leaves out.

The worker resolves them at start-up (worker.generation_defaults: the model's
generation_config.json, `--generation-config`, `--override-generation-config`) and publishes
them in its ModelCard; the gateway fills them into a request's unsent fields
(gateway.openai.generation_fields) and lists them in /v1/models. Keys are the API's names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """None: the API's own default (temperature 1, top_p 1, no top-k, no penalty, the route's
    max_tokens). The ranges are the API's, so a default is a value a request could send."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: off
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))  # JSON writes 1.0 as 1
        for name in ("top_k", "max_tokens"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty <= 10:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    def to_dict(self) -> dict[str, float | int]:
        """The defaults that are set (what the card carries and /v1/models shows)."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingDefaults:
        """From `to_dict`'s form; an unknown key or a bad value is a ValueError."""
        unknown = sorted(set(data) - FIELDS)
        if unknown:
            known = ", ".join(sorted(FIELDS))
            raise ValueError(f"unknown sampling default(s) {', '.join(unknown)}; known: {known}")
        return cls(**data)

    def updated(self, other: SamplingDefaults) -> SamplingDefaults:
        """These defaults with `other`'s set ones winning."""
        return replace(self, **other.to_dict())


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


FIELDS = frozenset(f.name for f in fields(SamplingDefaults))
