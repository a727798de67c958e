"""The relay: one request's replies, from its queue to the client, as a JSON body or an SSE
stream, and how the request ended.

Replies carry the choice they belong to (`index`). A normal final reply ("stop", "length") ends
its choice; the response is complete when every choice has ended, here (a stop string) or in the
worker. Any other final reply (error, abort, expired) ends the whole request with an error. A
stop string found in one choice while others go on cancels that choice only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from gateway.openai.choices import NORMAL_FINISH, Choice, Delta
from gateway.openai.errors import ApiError
from gateway.openai.response_bodies import DONE, KEEPALIVE, Responder, sse, usage
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


class Relay:
    def __init__(
        self,
        gw: Gateway,
        in_flight: InFlight,
        model: ServedModel,
        responder: Responder,
        choices: list[Choice],
        num_prompt: int,
        received: float,
    ):
        self.gw = gw
        self.in_flight = in_flight
        self.model = model
        self.responder = responder
        self.choices = choices
        self.num_prompt = num_prompt
        self.received = received
        self.finished = False  # the worker ended the request (every choice, or an error)
        self.error: ReplyMessage | None = None  # the final reply that failed the request
        self.prompt_logprobs: list[list[Any]] | None = None  # from the request's first reply
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._first = True

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
        if not self.in_flight.started and timeout is not None:
            return timeout + EXPIRY_GRACE_S
        return self.gw.config.reply_idle_timeout_s

    async def next_reply(self, timeout: float) -> ReplyMessage:
        # NOTE: asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the cancellation
        # that a client disconnect delivers (gh-86296).
        async with asyncio.timeout(timeout):
            reply = await self.in_flight.queue.get()
        if self._first:
            self._first = False
            self.gw.metrics.ttft.labels(self.model.name).observe(time.monotonic() - self.received)
        return reply

    def apply(self, reply: ReplyMessage) -> tuple[Choice, Delta] | None:
        """One reply applied to its choice; what it adds, if it belongs to a live choice."""
        if reply.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = reply.prompt_logprobs
        if reply.is_final:
            self.prompt_tokens = max(self.prompt_tokens, reply.prompt_tokens)
            self.cached_tokens = max(self.cached_tokens, reply.cached_tokens)
            if reply.finish_reason not in NORMAL_FINISH:
                self.error, self.finished = reply, True
                return None
        if not 0 <= reply.index < len(self.choices):
            log.warning("reply for a choice out of range request_id=%s", reply.request_id)
            return None
        choice = self.choices[reply.index]
        was_done = choice.done
        delta = choice.add(reply, self.prompt_logprobs)
        self.finished = all(c.worker_done for c in self.choices)
        if choice.stopped and not was_done and not self.done:  # the others go on
            self.gw.cancel_later(self.responder.request_id, STOP_STRING, index=choice.index)
        return choice, delta

    def usage(self) -> dict[str, Any]:
        completion = sum(c.usage_tokens for c in self.choices)
        return usage(self.prompt_tokens or self.num_prompt, completion, self.cached_tokens)

    async def collect(self) -> web.Response:
        body = await self.collect_body()
        return web.json_response(body, headers={"X-Request-Id": self.responder.request_id})

    async def collect_body(self) -> dict[str, Any]:
        """The whole (non-streamed) response body, or the ApiError the request ended with."""
        while not self.done:
            try:
                reply = await self.next_reply(self._wait_limit())
            except TimeoutError:
                raise idle_timeout_error() from None
            self.apply(reply)
        if self.error is not None:
            raise final_error(self.error)
        r = self.responder
        choices = []
        for c in self.choices:
            text, logprobs, calls, reason = c.result()
            tool_calls = [call.message() for call in calls] or None
            choices.append(r.choice(c.index, text, reason, logprobs, tool_calls))
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

    async def _stream_replies(self, response: web.StreamResponse) -> None:
        silent_s = 0.0
        keepalive = self.gw.config.sse_keepalive_s
        while True:
            wait = min(keepalive, self._wait_limit() - silent_s)
            try:
                reply = await self.next_reply(max(wait, 0.0))
            except TimeoutError:
                silent_s += wait
                if silent_s >= self._wait_limit():
                    await response.write(sse(idle_timeout_error().body()))
                    return
                await response.write(KEEPALIVE)
                continue
            silent_s = 0.0
            if (applied := self.apply(reply)) is not None:
                for chunk in self._chunks(*applied):
                    await response.write(sse(chunk))
            if self.error is not None:
                await response.write(sse(final_error(self.error).body()))
                return
            if self.done:
                if self.responder.include_usage:
                    await response.write(sse(self.responder.usage_chunk(self.usage())))
                return

    def _chunks(self, choice: Choice, delta: Delta) -> list[dict[str, Any]]:
        """The stream chunks of one delta: text (with log-probs), each tool call (its name, then
        its arguments), then the finish."""
        r, i = self.responder, choice.index
        chunks = []
        if delta.text or delta.logprobs:
            chunks.append(r.chunk(delta.text, logprobs=delta.logprobs, index=i))
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
