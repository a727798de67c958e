"""POST /v1/completions and /v1/chat/completions: validate, tokenize, admit, enqueue, reply.

A request's life here, in order (nothing is enqueued until step 5; any error before it is a 4xx
or 503 with nothing left behind):
1. parse + validate the body (gateway.schema);           4. backlog bound (429, Retry-After);
2. resolve the model (404), tokenize on the tokenizer     5. XADD the RequestMessage, then send
   thread (chat template for chat);                          headers (stream) or wait (not);
3. prompt + max_tokens within max_model_len (400);        6. relay replies until the final one.
Leaving before the final reply (client gone, idle timeout, error) publishes a cancel.

Workers send token ids; the text is made here (protocol.detokenizer), so it costs the workers'
steps nothing and the gateways, which scale out, pay it. A stop string found here ends the
response at once and cancels the rest of the work (the worker stops within a step or two).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from gateway.errors import ApiError, bad_request, redis_unavailable, shutting_down
from gateway.logprobs import LogprobsFormatter, merge
from gateway.models import ServedModel
from gateway.ratelimit import charge_tokens
from gateway.replies import InFlight
from gateway.responses import DONE, KEEPALIVE, Kind, Responder, sse, usage
from gateway.schema import ChatRequest, CompletionRequest, parse_chat, parse_completion, parse_json
from gateway.service import Gateway
from protocol import STOP_STRING, ReplyMessage, RequestMessage
from protocol.detokenizer import IncrementalDetokenizer

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
NORMAL_FINISH = frozenset({"stop", "length"})
# A worker reports "expired" when it drops a request past its deadline; allow it this long.
EXPIRY_GRACE_S = 5.0
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    if gw.draining:  # a load balancer that has not noticed /ready yet: send it elsewhere
        raise shutting_down()
    gw.active_requests += 1  # a drain waits for these, tokenizing ones included
    try:
        return await _serve(request, kind, gw)
    finally:
        gw.active_requests -= 1


async def _serve(request: web.Request, kind: Kind, gw: Gateway) -> web.StreamResponse:
    received = time.monotonic()
    body = parse_json(await request.read())  # over client_max_size: 413 via the middleware
    parsed = parse_chat(body) if kind == "chat" else parse_completion(body)
    model = await gw.registry.resolve(parsed.model)
    prompt_ids = await _prompt_ids(gw, model, parsed)
    max_tokens = _max_tokens(gw, model, parsed, len(prompt_ids))
    if parsed.min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({parsed.min_tokens}) must be at most max_tokens ({max_tokens}).",
            param="min_tokens",
        )
    if any(token >= model.vocab_size for token, _ in parsed.sampling.logit_bias):
        raise bad_request(
            f"'logit_bias' names token ids outside the vocabulary (size {model.vocab_size}).",
            param="logit_bias",
        )
    sampling = replace(
        parsed.sampling, max_tokens=max_tokens, min_tokens=parsed.min_tokens, detokenize=False
    )
    await charge_tokens(request, len(prompt_ids) + sampling.max_tokens)  # per-key tokens/min
    await gw.backlog.admit(len(prompt_ids))  # from here to register(): no await (atomic)

    responder = Responder(kind, model.name, parsed.include_usage)
    now = time.time()
    timeout = gw.config.request_timeout
    message = RequestMessage(
        request_id=responder.request_id,
        model=model.name,
        prompt_token_ids=prompt_ids,
        sampling=sampling.to_dict(),
        reply_to=gw.reply_stream,
        gateway_id=gw.config.gateway_id,
        enqueue_time=now,
        deadline=None if timeout is None else now + timeout,
    )
    in_flight = gw.router.register(responder.request_id, len(prompt_ids))
    detok = IncrementalDetokenizer.create(model.decoder, prompt_ids, sampling.stop)
    relay = _Relay(gw, in_flight, model, responder, detok, len(prompt_ids), received)
    if sampling.logprobs is not None:
        relay.logprobs = LogprobsFormatter(kind, model.decoder)
    enqueued = True  # maybe: a client gone during XADD still gets its request cancelled
    try:
        try:
            in_flight.entry_id = await gw.backlog.enqueue(message)
        except RedisError:
            enqueued = False
            gw.backlog.release(len(prompt_ids))
            raise redis_unavailable() from None
        return await (relay.stream(request) if parsed.stream else relay.collect())
    finally:
        gw.router.unregister(responder.request_id)
        if enqueued and not relay.finished:  # stop string, client gone, timeout: stop the work
            gw.cancel_later(responder.request_id, STOP_STRING if detok.stopped else "client_gone")


async def _prompt_ids(
    gw: Gateway, model: ServedModel, parsed: CompletionRequest | ChatRequest
) -> list[int]:
    if isinstance(parsed, ChatRequest) or isinstance(parsed.prompt, str):
        if isinstance(parsed, ChatRequest):
            ids = await gw.registry.run(model.chat_ids, parsed.messages)
        else:
            ids = await gw.registry.run(model.encode, parsed.prompt)
        if not ids:
            raise bad_request("The prompt is empty after tokenization.", param=_param(parsed))
        return ids
    if max(parsed.prompt) >= model.vocab_size:
        raise bad_request(
            f"'prompt' holds token ids outside the vocabulary (size {model.vocab_size}).",
            param="prompt",
        )
    return parsed.prompt


def _param(parsed: CompletionRequest | ChatRequest) -> str:
    return "messages" if isinstance(parsed, ChatRequest) else "prompt"


def _max_tokens(
    gw: Gateway, model: ServedModel, parsed: CompletionRequest | ChatRequest, num_prompt: int
) -> int:
    """The client's max_tokens or the route's default, refused (400) past the context window."""
    limit = model.card.max_model_len
    max_tokens = parsed.max_tokens
    if max_tokens is None:  # chat: as much as fits, capped; completions: OpenAI's 16
        if isinstance(parsed, ChatRequest):
            max_tokens = max(1, min(gw.config.chat_default_max_tokens, limit - num_prompt))
        else:
            max_tokens = gw.config.completion_default_max_tokens
    if num_prompt + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for "
            f"the completion). Please reduce the prompt or max_tokens.",
            param=_param(parsed),
            code="context_length_exceeded",
        )
    return max_tokens


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


class _Relay:
    """Moves one request's replies from its queue to the client, and remembers how it ended."""

    def __init__(
        self,
        gw: Gateway,
        in_flight: InFlight,
        model: ServedModel,
        responder: Responder,
        detok: IncrementalDetokenizer,
        num_prompt: int,
        received: float,
    ):
        self.gw = gw
        self.in_flight = in_flight
        self.model = model
        self.responder = responder
        self.detok = detok
        self.num_prompt = num_prompt
        self.received = received
        self.finished = False  # the worker's final reply arrived
        self.logprobs: LogprobsFormatter | None = None  # when the request asked for them
        self.num_tokens = 0
        self._first = True

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
        self.num_tokens += len(reply.token_ids)
        self.finished = reply.is_final
        return reply

    def text_of(self, reply: ReplyMessage) -> str:
        """The text that became final with this reply's tokens; at a normal end, also what was
        held back (an incomplete character, a possible start of a stop string)."""
        text = "".join([self.detok.add(token) for token in reply.token_ids])
        if reply.finish_reason in NORMAL_FINISH:
            text += self.detok.finish()
        return text

    def logprobs_of(self, reply: ReplyMessage) -> dict[str, Any] | None:
        """The OpenAI logprobs object of this reply's tokens, when the request asked."""
        if self.logprobs is None or not reply.token_ids:
            return None
        return self.logprobs.part(reply.token_ids, reply.logprobs)

    def end_reason(self, reply: ReplyMessage) -> str | None:
        """How the response ends after `reply` (None: it goes on). A stop string found here
        ends it before the worker's final reply."""
        return "stop" if self.detok.stopped else reply.finish_reason

    def usage(self, final: ReplyMessage) -> dict[str, Any]:
        return usage(
            final.prompt_tokens or self.num_prompt,
            final.completion_tokens or self.num_tokens,
            final.cached_tokens,
        )

    async def collect(self) -> web.Response:
        parts: list[str] = []
        logprob_parts: list[dict[str, Any]] = []
        while True:
            try:
                reply = await self.next_reply(self._wait_limit())
            except TimeoutError:
                raise idle_timeout_error() from None
            parts.append(self.text_of(reply))
            if (logprobs := self.logprobs_of(reply)) is not None:
                logprob_parts.append(logprobs)
            if (reason := self.end_reason(reply)) is not None:
                break
        if reason not in NORMAL_FINISH:
            raise final_error(reply)
        logprobs = None
        if self.logprobs is not None:  # asked for: an empty object when no token came
            logprobs = merge(logprob_parts) or self.logprobs.part([], [])
        body = self.responder.body("".join(parts), reason, self.usage(reply), logprobs)
        return web.json_response(body, headers={"X-Request-Id": self.responder.request_id})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={**SSE_HEADERS, "X-Request-Id": self.responder.request_id}
        )
        r = self.responder
        try:
            await response.prepare(request)  # headers go out only now, after XADD returned
            if r.kind == "chat":
                await response.write(sse(r.chunk(role=True)))
            await self._stream_replies(response)
            await response.write(DONE)
            await response.write_eof()
        except ConnectionError:  # the client went away mid-write; the caller cancels
            pass
        return response

    async def _stream_replies(self, response: web.StreamResponse) -> None:
        r = self.responder
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
            text, logprobs = self.text_of(reply), self.logprobs_of(reply)
            if text or logprobs:
                await response.write(sse(r.chunk(text, logprobs=logprobs)))
            if (reason := self.end_reason(reply)) is None:
                continue
            if reason in NORMAL_FINISH:
                await response.write(sse(r.chunk("", reason)))
                if r.include_usage:
                    await response.write(sse(r.usage_chunk(self.usage(reply))))
            else:
                await response.write(sse(final_error(reply).body()))
            return
