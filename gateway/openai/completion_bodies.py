"""The chat and completions APIs' response objects: whole bodies, stream chunks and usage (the
SSE framing is gateway.openai.sse; the Responses API's objects are gateway.openai.responses_*)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "completion"]


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    reasoning_tokens: int | None = None,  # None: no reasoning parser (the detail left out)
    draft_tokens: int = 0,  # speculative decoding's draft tokens verified, and those kept
    accepted_draft_tokens: int = 0,
) -> dict[str, Any]:
    """OpenAI's usage object. Speculation's drafts, when there were any, are reported as
    OpenAI reports a prediction's (Predicted Outputs): accepted_prediction_tokens are in the
    completion, rejected_prediction_tokens were computed and dropped."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    details: dict[str, int] = {}
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = reasoning_tokens
    if draft_tokens:
        details["accepted_prediction_tokens"] = accepted_draft_tokens
        details["rejected_prediction_tokens"] = draft_tokens - accepted_draft_tokens
    if details:
        out["completion_tokens_details"] = details
    return out


def _reasoning(fields: dict[str, Any], reasoning: str | None) -> None:
    """A message's or delta's reasoning, under both its names: `reasoning_content` (DeepSeek's
    API, vLLM before 0.11) and `reasoning` (vLLM's since)."""
    fields["reasoning_content"] = fields["reasoning"] = reasoning


@dataclass(slots=True)
class Responder:
    """Builds every object one request answers with; ids and `created` are fixed per request."""

    kind: Kind
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex

    @property
    def request_id(self) -> str:
        return self.id

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str | None = None,
        reasoning_parsed: bool = False,
    ) -> dict[str, Any]:
        """One choice of a whole (non-streamed) body. Chat: `text` None is a null content (a
        reply that is only tool calls, or reasoning); with `reasoning_parsed` (the model has a
        reasoning parser) the message has its `reasoning`, null when there was none."""
        if self.kind == "completion":
            return {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning_parsed:
            _reasoning(message, reasoning)
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def body(self, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(
            "chat.completion" if self.kind == "chat" else "text_completion", choices
        )
        out["usage"] = usage_
        return out

    def chunk(
        self,
        text: str = "",
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str = "",
    ) -> dict[str, Any]:
        """One stream chunk of choice `index`; chat: `tool_calls` are delta entries (index, and
        id, type and function.name in a call's first one, then function.arguments), and
        `reasoning` its reasoning text (content and reasoning never in one delta)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if reasoning:
                _reasoning(delta, reasoning)
            if text or role:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            out = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            out = self._envelope("text_completion", [choice])
        if self.include_usage:
            out["usage"] = None  # as OpenAI: every chunk has it, only the last one fills it
        return out

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(
            "chat.completion.chunk" if self.kind == "chat" else "text_completion", []
        )
        out["usage"] = usage_
        return out
