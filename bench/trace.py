"""Benchmark traces (shared/traces format) and the percentile every report uses; torch-free, so
the live load generator can use it without loading a model stack."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True, frozen=True)
class TraceRequest:
    request_id: str
    prompt_ids: list[int]
    output_len: int  # exact: generate this many tokens, ignoring EOS
    arrival_s: float = 0.0  # offline runs ignore it (everything arrives at t=0)


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a shared/traces file; `limit` keeps only the first requests (in trace order)."""
    return trace_requests(json.loads(Path(path).read_text()), limit)


def trace_requests(data: dict[str, Any], limit: int | None = None) -> list[TraceRequest]:
    """The requests of a trace already in memory (the shared/traces format)."""
    return [
        TraceRequest(
            request_id=str(r["id"]),
            prompt_ids=[int(t) for t in r["prompt_ids"]],
            output_len=int(r["output_len"]),
            arrival_s=float(r.get("arrival_s", 0.0)),
        )
        for r in data["requests"][:limit]
    ]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
