"""The Responses API's answer: the response object, its output items, and the typed stream
events that build them, each with its `sequence_number`.

`ResponseBuilder` takes a choice's deltas (reasoning, text, tool calls) as the relay applies
them and keeps the output items, returning the events each delta makes: reasoning (a model with
a reasoning parser) goes into a `reasoning` item (`reasoning_text` content, streamed as
`response.reasoning_text.delta`), the text into a `message` item (`output_text` content), each
call is a `function_call` item of its own, in the order the model wrote them (text after a call
opens a new message). A whole response is the same items with the events left unread, so a
stream and a body always agree. An output with no item is one empty message. A response cut by
max_output_tokens is `incomplete`, its open item too, and a stream ends with
`response.incomplete` instead of `response.completed`, as OpenAI's API does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.choices import Delta
from gateway.openai.errors import ApiError
from gateway.openai.generation_fields import GenerationFields
from gateway.openai.responses_models import ResponsesRequest
from gateway.openai.tool_parser import ToolCall

MAX_OUTPUT_TOKENS = "max_output_tokens"  # incomplete_details.reason of a response cut short


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def echo(request: ResponsesRequest, chat: GenerationFields) -> dict[str, Any]:
    """The request's fields a response object repeats; temperature and top_p as used (the
    model's defaults where the request gave none)."""
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "name": choice.name}
    fmt = request.text_format
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "prompt_cache_key": request.prompt_cache_key,
        "reasoning": None,
        "safety_identifier": request.safety_identifier,
        "service_tier": request.service_tier or "default",
        "store": request.store,
        "temperature": chat.temperature,
        "text": {"format": fmt.echo() if fmt is not None else {"type": "text"}},
        "tool_choice": choice or "auto",
        "tools": [t.echo() for t in request.tools],
        "top_p": chat.top_p,
        "truncation": "disabled",
        "user": request.user,
    }


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """The relay's (chat-shaped) usage in this API's names."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    reasoning = chat_usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": chat_usage["total_tokens"],
    }


@dataclass(frozen=True, slots=True)
class ResponseShell:
    """What every form of one response shares: its id, time, model and the request's echo."""

    id: str
    model: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": MAX_OUTPUT_TOKENS} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


@dataclass(frozen=True, slots=True)
class TextItem:
    """An output item that text streams into: its shape and its events' names."""

    prefix: str  # of its id
    fields: dict[str, Any]  # besides id, status and content
    part: Callable[[str], dict[str, Any]]  # its one content part, with the text so far
    events: str  # its text events: `{events}.delta`, `{events}.done`
    logprobs: bool  # its text events carry (empty) logprobs


MESSAGE = TextItem(
    "msg", {"type": "message", "role": "assistant"}, _text_part, "response.output_text", True
)
REASONING = TextItem(
    "rs", {"type": "reasoning", "summary": []}, _reasoning_part, "response.reasoning_text", False
)


@dataclass(slots=True)
class ResponseBuilder:
    shell: ResponseShell
    output: list[dict[str, Any]] = field(default_factory=list)
    _open: dict[str, Any] | None = None  # the item text streams into, while open...
    _open_kind: TextItem = MESSAGE  # ...and what it is
    _seq: int = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def started(self) -> list[dict[str, Any]]:
        body = self.shell.body("in_progress", [])
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def add(self, delta: Delta) -> list[dict[str, Any]]:
        events = []
        for kind, text in ((REASONING, delta.reasoning), (MESSAGE, delta.text)):
            if text:
                events += self._write(kind, text)
        for call in delta.calls:
            events += self._close("completed")
            events += self._call(call)
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """The events that close the output once the choice ended."""
        events = [] if self.output else self._open_item(MESSAGE)
        return events + self._close("incomplete" if incomplete else "completed")

    def ended(self, body: dict[str, Any]) -> dict[str, Any]:
        """The last event: the whole response, completed or incomplete."""
        return self._event(f"response.{body['status']}", response=body)

    def failed(self, error: ApiError) -> list[dict[str, Any]]:
        """A stream's end when the request failed: the error, then the response, failed."""
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        failure = {"code": code, "message": error.message}
        body = self.shell.body("failed", self.output, error=failure)
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=body),
        ]

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _write(self, kind: TextItem, text: str) -> list[dict[str, Any]]:
        """`text` into the open item of `kind` (another open item closes first)."""
        events = []
        if self._open is not None and self._open_kind is not kind:
            events += self._close("completed")
        events += self._open_item(kind)
        assert self._open is not None
        self._open["content"][0]["text"] += text
        where = {**self._where(self._open), "content_index": 0}
        extra = {"logprobs": []} if kind.logprobs else {}
        return [*events, self._event(f"{kind.events}.delta", **where, delta=text, **extra)]

    def _open_item(self, kind: TextItem) -> list[dict[str, Any]]:
        if self._open is not None:
            return []
        item = {"id": new_id(kind.prefix), **kind.fields, "status": "in_progress", "content": []}
        self.output.append(item)
        self._open, self._open_kind = item, kind
        added = self._event("response.output_item.added", output_index=len(self.output) - 1)
        added["item"] = {**item, "content": []}
        item["content"].append(kind.part(""))
        part = self._event(
            "response.content_part.added", **self._where(item), content_index=0, part=kind.part("")
        )
        return [added, part]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, kind, self._open = self._open, self._open_kind, None
        if item is None:
            return []
        item["status"] = status
        text = item["content"][0]["text"]
        where = {**self._where(item), "content_index": 0}
        extra = {"logprobs": []} if kind.logprobs else {}
        return [
            self._event(f"{kind.events}.done", **where, text=text, **extra),
            self._event("response.content_part.done", **where, part=kind.part(text)),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
        }
        self.output.append(item)
        index = len(self.output) - 1
        added = self._event("response.output_item.added", output_index=index, item=dict(item))
        item.update(arguments=call.arguments, status="completed")
        where = self._where(item)
        return [
            added,
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=call.name,
                arguments=call.arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
