"""Function calling, output side: a choice's text read back into content and tool calls.

A call is a `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block (Hermes, Qwen,
SmolLM2), or the whole output as one bare `{"name": ..., "parameters"|"arguments": ...}` object
(Llama 3). A call must name an offered tool and hold a JSON object; anything else (malformed
JSON, an unknown name) stays content, as written. With calls, the content is the text around
them, stripped (None when empty).

Streaming gives the same result: text that may be the start of a `<tool_call>` tag is held back,
a call is sent once its block is complete (so malformed JSON can still turn out to be content),
and an output that starts with `{` is held to its end (it may be a bare call).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.tools import CALL_CLOSE, CALL_OPEN


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def message(self) -> dict[str, Any]:
        """OpenAI's message.tool_calls entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_call(text: str, names: frozenset[str]) -> ToolCall | None:
    """One call from its JSON, or None when it is not one."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_output(text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
    """A whole output: its content and its calls."""
    events = ToolStream(names)
    parts = events.feed(text) + events.finish()
    calls = [p for p in parts if isinstance(p, ToolCall)]
    content = "".join(p for p in parts if isinstance(p, str))
    if not calls:
        return content, []
    return content or None, calls


@dataclass(slots=True)
class ToolStream:
    """Incremental: feed the choice's text deltas, get content deltas (str) and calls."""

    names: frozenset[str]
    _buffer: str = ""  # text not yet sent: a possible tag start, or an open call's body
    _in_call: bool = False  # _buffer is the body of an open <tool_call>
    _bare: bool = False  # the output began with "{": held whole to the end
    _pending_space: str = ""  # whitespace held until text follows (dropped around calls)
    _sent_text: bool = False
    _num_calls: int = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        if self._bare:
            return []
        if not self._sent_text and not self._num_calls and not self._in_call:
            stripped = self._buffer.lstrip()
            if stripped.startswith("{"):
                self._bare = True
                return []
            if not stripped:
                return []
        return self._drain()

    def finish(self) -> list[str | ToolCall]:
        if self._bare:
            call = parse_call(self._buffer.strip(), self.names)
            if call is not None:
                return [call]
            self._bare = False  # not a bare call: read it as ordinary text
            out = self._drain()
        else:
            out = []
        if self._in_call:  # an unterminated call (the model ended without its closing tag)
            out += self._close_call(self._buffer)
        elif self._buffer:
            out += self._content(self._buffer)
        self._buffer = ""
        if self._pending_space and not self._num_calls:
            out.append(self._pending_space)
        return out

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def _drain(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_CLOSE)
                if end == -1:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE) :]
                out += self._close_call(body, closed=True)
                continue
            start = self._buffer.find(CALL_OPEN)
            if start != -1:
                out += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(CALL_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_tag(self._buffer)
            out += self._content(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def _close_call(self, body: str, closed: bool = False) -> list[str | ToolCall]:
        self._in_call = False
        call = parse_call(body.strip(), self.names)
        if call is None:  # not a call after all: the block is content, as written
            return self._content(CALL_OPEN + body + (CALL_CLOSE if closed else ""))
        self._num_calls += 1
        return [call]

    def _content(self, text: str) -> list[str | ToolCall]:
        """Text outside calls; whitespace waits for the text after it, so whitespace next to
        a call is dropped (the content is stripped)."""
        if not text:
            return []
        if not text.strip():
            self._pending_space += text
            return []
        body = text.rstrip()
        lead = self._pending_space if (self._sent_text or not self._num_calls) else ""
        if not self._sent_text and self._num_calls:
            body = body.lstrip()
        self._pending_space = text[len(text.rstrip()) :]
        self._sent_text = True
        return [lead + body]


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the opening tag."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_OPEN[:n]):
            return n
    return 0
