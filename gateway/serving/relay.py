"""The relay: one request's replies, from its queue to the client, as a JSON body or an SSE
stream, and how the request ended.

A request is one queue entry per prompt (a completions list has several), each with its `n`
choices; every entry's replies come to one queue, read in arrival order. A reply names its entry
(request id) and its choice there (`index`: 0..n-1); the response numbers the choices across
prompts, prompt i's as i*n .. i*n+n-1 (OpenAI's order). A normal final reply ("stop", "length")
ends its choice; the response is complete when every choice has ended, here (a stop string) or
in the worker. Any other final reply (error, abort, expired) ends the whole request with an
error. A stop string found in one choice while others go on cancels that choice only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.openai.choices import NORMAL_FINISH, Choice, Delta
from gateway.openai.completion_bodies import Responder, usage
from gateway.openai.errors import ApiError
from gateway.openai.sse import DONE, KEEPALIVE, sse
from gateway.serving.gateway_state import Gateway
from gateway.serving.reply_router import InFlight
from gateway.serving.served_models import ServedModel
from protocol import STOP_STRING, ReplyMessage

log = logging.getLogger(__name__)

# A worker reports "expired" when it drops a request past its deadline; allow it this long.
EXPIRY_GRACE_S = 5.0
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


def final_error(reply: ReplyMessage) -> ApiError:
    """The HTTP error for a final reply that is not a normal finish."""
    if reply.finish_reason == "expired":
        return ApiError(
            504,
            "The request waited in the queue past its deadline and was dropped.",
            type="timeout_error",
            code="request_expired",
        )
    if reply.finish_reason == "abort":
        return ApiError(
            503,
            reply.error or "The request was aborted by the server (e.g. a worker shut down).",
            type="service_unavailable",
            code="aborted",
            headers={"Retry-After": "1"},
        )
    message = reply.error or "The request failed in the worker."
    if reply.error_type == "invalid_request_error":
        return ApiError(400, message, code="worker_rejected")
    return ApiError(500, message, type="server_error", code="worker_error")


def idle_timeout_error() -> ApiError:
    return ApiError(
        504,
        "No reply from any worker in time; the request was cancelled.",
        type="timeout_error",
        code="reply_timeout",
    )


@dataclass(slots=True, eq=False)
class PromptEntry:
    """One prompt's queue entry: its replies' state and its choices (the worker's index i is
    choices[i])."""

    request_id: str
    in_flight: InFlight
    choices: list[Choice]
    num_prompt: int
    prompt_logprobs: list[list[Any]] | None = None  # from the entry's first reply (echo)
    prompt_tokens: int = 0  # as the worker's final replies count them
    cached_tokens: int = 0
    failed: bool = False  # a final reply that is not a normal finish ended it

    @property
    def finished(self) -> bool:
        """The worker ended it (every choice, or with an error): nothing to cancel."""
        return self.failed or all(c.worker_done for c in self.choices)

    @property
    def complete(self) -> bool:
        """Every choice ended normally (here, or in the worker)."""
        return all(c.done for c in self.choices)


class Relay:
    def __init__(
        self,
        gw: Gateway,
        model: ServedModel,
        responder: Responder,
        entries: list[PromptEntry],
        received: float,
    ):
        self.gw = gw
        self.model = model
        self.responder = responder
        self.entries = entries
        self.choices = [c for e in entries for c in e.choices]  # in response order
        self.received = received
        self.error: ReplyMessage | None = None  # the final reply that failed the request
        self._by_id = {e.request_id: e for e in entries}
        self._replies: asyncio.Queue[ReplyMessage] = asyncio.Queue()
        for entry in entries:  # before XADD: no reply can have arrived yet
            entry.in_flight.queue = self._replies
        self._first = True

    @property
    def finished(self) -> bool:
        """The worker ended every entry (every choice, or an error)."""
        return all(e.finished for e in self.entries)

    @property
    def done(self) -> bool:
        """Nothing more goes to the client."""
        return self.error is not None or self.complete

    @property
    def complete(self) -> bool:
        """Every choice ended normally."""
        return all(c.done for c in self.choices)

    def _wait_limit(self) -> float:
        timeout = self.gw.config.request_timeout
        if not all(e.in_flight.started for e in self.entries) and timeout is not None:
            return timeout + EXPIRY_GRACE_S
        return self.gw.config.reply_idle_timeout_s

    async def next_reply(self, timeout: float) -> ReplyMessage:
        # NOTE: asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the cancellation
        # that a client disconnect delivers (gh-86296).
        async with asyncio.timeout(timeout):
            reply = await self._replies.get()
        if self._first:
            self._first = False
            self.gw.metrics.ttft.labels(self.model.name).observe(time.monotonic() - self.received)
        return reply

    def apply(self, reply: ReplyMessage) -> tuple[Choice, Delta] | None:
        """One reply applied to its choice; what it adds, if it belongs to a live choice."""
        entry = self._by_id.get(reply.request_id)
        if entry is None:
            log.warning("reply for another request request_id=%s", reply.request_id)
            return None
        if reply.prompt_logprobs is not None and entry.prompt_logprobs is None:
            entry.prompt_logprobs = reply.prompt_logprobs
        if reply.is_final:
            entry.prompt_tokens = max(entry.prompt_tokens, reply.prompt_tokens)
            entry.cached_tokens = max(entry.cached_tokens, reply.cached_tokens)
            if reply.finish_reason not in NORMAL_FINISH:
                entry.failed = True
                self.error = self.error or reply
                return None
        if not 0 <= reply.index < len(entry.choices):
            log.warning("reply for a choice out of range request_id=%s", reply.request_id)
            return None
        choice = entry.choices[reply.index]
        was_done = choice.done
        delta = choice.add(reply, entry.prompt_logprobs)
        if choice.stopped and not was_done and not self.done:  # the others go on
            self.gw.cancel_later(entry.request_id, STOP_STRING, index=reply.index)
        return choice, delta

    def usage(self) -> dict[str, Any]:
        """Summed over the prompts: each counted once whatever its `n`; the reasoning's tokens
        too when the model has a reasoning parser."""
        prompt = sum(e.prompt_tokens or e.num_prompt for e in self.entries)
        cached = sum(e.cached_tokens for e in self.entries)
        completion = sum(c.usage_tokens for c in self.choices)
        reasoning = None
        if any(c.reasoning is not None for c in self.choices):
            reasoning = sum(c.reasoning_tokens for c in self.choices)
        drafts = sum(c.draft_tokens for c in self.choices)
        accepted = sum(c.accepted_draft_tokens for c in self.choices)
        return usage(prompt, completion, cached, reasoning, drafts, accepted)

    async def collect(self) -> web.Response:
        body = await self.collect_body()
        return web.json_response(body, headers={"X-Request-Id": self.responder.request_id})

    async def collect_body(self) -> dict[str, Any]:
        """The whole (non-streamed) response body, or the ApiError the request ended with."""
        async for _ in self.updates():
            pass
        if self.error is not None:
            raise final_error(self.error)
        r = self.responder
        choices = []
        for c in self.choices:
            text, logprobs, calls, reason = c.result()
            tool_calls = [call.message() for call in calls] or None
            parsed = c.reasoning is not None
            choices.append(
                r.choice(c.index, text, reason, logprobs, tool_calls, c.reasoning_text, parsed)
            )
        return r.body(choices, self.usage())

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={**SSE_HEADERS, "X-Request-Id": self.responder.request_id}
        )
        r = self.responder
        try:
            await response.prepare(request)  # headers go out only now, after XADD returned
            if r.kind == "chat":
                for c in self.choices:
                    await response.write(sse(r.chunk(role=True, index=c.index)))
            await self._stream_replies(response)
            await response.write(DONE)
            await response.write_eof()
        except ConnectionError:  # the client went away mid-write; the caller cancels
            pass
        return response

    async def updates(
        self, keepalive_s: float | None = None
    ) -> AsyncIterator[tuple[Choice, Delta] | None]:
        """The replies applied in arrival order until nothing more goes to the client (every
        choice ended, or `error` is set): what each added to its choice, and None after each
        `keepalive_s` of silence (a stream's keep-alive). No reply in time: idle_timeout_error.
        Every way of answering (a body, a stream, the Responses API's events) reads this."""
        silent_s = 0.0
        while not self.done:
            limit = self._wait_limit()
            wait = limit - silent_s if keepalive_s is None else min(keepalive_s, limit - silent_s)
            try:
                reply = await self.next_reply(max(wait, 0.0))
            except TimeoutError:
                silent_s += wait
                if silent_s >= self._wait_limit():
                    raise idle_timeout_error() from None
                yield None
                continue
            silent_s = 0.0
            if (applied := self.apply(reply)) is not None:
                yield applied

    async def _stream_replies(self, response: web.StreamResponse) -> None:
        try:
            async for applied in self.updates(self.gw.config.sse_keepalive_s):
                if applied is None:
                    await response.write(KEEPALIVE)
                    continue
                for chunk in self._chunks(*applied):
                    await response.write(sse(chunk))
        except ApiError as e:  # no reply in time
            await response.write(sse(e.body()))
            return
        if self.error is not None:
            await response.write(sse(final_error(self.error).body()))
        elif self.responder.include_usage:
            await response.write(sse(self.responder.usage_chunk(self.usage())))

    def _chunks(self, choice: Choice, delta: Delta) -> list[dict[str, Any]]:
        """The stream chunks of one delta: reasoning, text (each with the log-probs when first),
        each tool call (its name, then its arguments), then the finish."""
        r, i = self.responder, choice.index
        chunks = []
        logprobs = delta.logprobs
        if delta.reasoning:
            chunks.append(r.chunk(logprobs=logprobs, index=i, reasoning=delta.reasoning))
            logprobs = None
        if delta.text or logprobs:
            chunks.append(r.chunk(delta.text, logprobs=logprobs, index=i))
        first = (choice.tools.num_calls if choice.tools else 0) - len(delta.calls)
        for k, call in enumerate(delta.calls, start=first):
            head = {"index": k, "id": call.id, "type": "function"}
            head["function"] = {"name": call.name, "arguments": ""}
            chunks.append(r.chunk(index=i, tool_calls=[head]))
            arguments = {"index": k, "function": {"arguments": call.arguments}}
            chunks.append(r.chunk(index=i, tool_calls=[arguments]))
        if delta.finish_reason is not None:
            chunks.append(r.chunk("", delta.finish_reason, index=i))
        return chunks
