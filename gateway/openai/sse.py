"""Server-sent events as both streaming APIs write them: an event's `data:` line, the keep-alive
comment, and the `[DONE]` that ends a chat or completions stream (a Responses API stream ends
with its own `response.completed` event instead)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
