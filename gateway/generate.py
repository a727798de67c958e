"""POST /v1/completions and /v1/chat/completions: validate, tokenize, admit, enqueue, reply.

A request's life here, in order (nothing is enqueued until step 5; any error before it is a 4xx
or 503 with nothing left behind):
1. parse + validate the body (gateway.schema);           4. backlog bound (429, Retry-After);
2. resolve the model (404), tokenize on the tokenizer     5. XADD the RequestMessage, then send
   thread (chat template for chat);                          headers (stream) or wait (not);
3. prompt + max_tokens within max_model_len, a grammar     6. relay replies until every
   that compiles (400);                                      choice ended (gateway.relay).
Leaving before the final reply (client gone, idle timeout, error) publishes a cancel.
Steps 1-3 are `prepare`, 4-6 `submit`: a Batch API line (gateway.batch_runner) takes the same
path without HTTP.

Workers send token ids; the text is made in the gateway (gateway.choices, one detokenizer per
choice), so it costs the workers' steps nothing and the gateways, which scale out, pay it. A stop
string found there ends its choice at once and cancels the rest of its work (the worker stops
within a step or two).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from aiohttp import web
from redis.exceptions import RedisError

from gateway import tools
from gateway.auth import CLIENT
from gateway.backlog import Queue
from gateway.choices import Choice, Echo
from gateway.errors import bad_request, redis_unavailable, shutting_down
from gateway.logprobs import LogprobsFormatter
from gateway.models import ServedModel
from gateway.ratelimit import charge_tokens
from gateway.relay import Relay
from gateway.responses import Kind, Responder
from gateway.schema import ChatRequest, CompletionRequest, parse_chat, parse_completion, parse_json
from gateway.service import Gateway
from gateway.structured import compile_error
from gateway.tool_parser import ToolStream
from protocol import STOP_STRING, RequestMessage, SamplingParams
from protocol.detokenizer import IncrementalDetokenizer

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
T = TypeVar("T")


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
    job = await prepare(gw, kind, body)
    await charge_tokens(request, job.cost)  # per-key tokens/min
    stream = job.parsed.stream

    async def deliver(relay: Relay) -> web.StreamResponse:
        return await (relay.stream(request) if stream else relay.collect())

    client = request.get(CLIENT)
    key_id = None if client is None else client.key_id
    priority = _priority(request, job.parsed)
    weight = None if client is None else client.weight
    return await submit(gw, job, priority, received, deliver, key_id=key_id, weight=weight)


@dataclass(frozen=True, slots=True)
class Job:
    """A request validated and tokenized: what is left is to admit and enqueue it."""

    kind: Kind
    parsed: CompletionRequest | ChatRequest
    model: ServedModel
    prompt_ids: list[int]
    sampling: SamplingParams

    @property
    def cost(self) -> int:
        """Tokens it may use: the prompt, and max_tokens for every choice."""
        return len(self.prompt_ids) + self.sampling.n * self.sampling.max_tokens


async def prepare(gw: Gateway, kind: Kind, body: dict[str, Any]) -> Job:
    """Steps 1-3: parse, resolve the model, tokenize, check limits and the grammar (4xx)."""
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
    if parsed.grammar is not None:  # compiled now: a bad one is a 400 before anything queues
        error = await gw.registry.run(model.grammar_error, parsed.grammar.text)
        if error is not None:
            raise compile_error(parsed.grammar, error)
    return Job(kind, parsed, model, prompt_ids, _wire_sampling(parsed, max_tokens))


async def submit(
    gw: Gateway,
    job: Job,
    priority: int,
    received: float,
    deliver: Callable[[Relay], Awaitable[T]],
    request_id: str = "",
    key_id: str | None = None,
    weight: int | None = None,
) -> T:
    """Steps 4-6: admit (429), enqueue, then `deliver` the replies (HTTP body or stream, or a
    batch line's body). Leaving before the final reply cancels the work."""
    parsed, prompt_ids, sampling = job.parsed, job.prompt_ids, job.sampling
    backlog = gw.backlog(job.model.name)
    await backlog.admit(len(prompt_ids))  # from here to register(): no await (atomic)

    responder = Responder(job.kind, job.model.name, parsed.include_usage, id=request_id)
    now = time.time()
    timeout = gw.config.request_timeout
    message = RequestMessage(
        request_id=responder.request_id,
        model=job.model.name,
        prompt_token_ids=prompt_ids,
        sampling=sampling.to_dict(),
        reply_to=gw.reply_stream,
        gateway_id=gw.config.gateway_id,
        enqueue_time=now,
        deadline=None if timeout is None else now + timeout,
        priority=priority,
        key_id=key_id,
    )
    in_flight = gw.router.register(responder.request_id, len(prompt_ids), priority)
    choices = _choices(job.model, parsed, prompt_ids, sampling, keep=not parsed.stream)
    relay = Relay(gw, in_flight, job.model, responder, choices, len(prompt_ids), received)
    enqueued = True  # maybe: a client gone during XADD still gets its request cancelled
    try:
        try:
            queue = Queue(priority, key_id if weight else None, weight or 1)
            in_flight.request_stream = backlog.queue(queue)
            in_flight.entry_id = await backlog.enqueue(message, queue, job.cost)
        except RedisError:
            enqueued = False
            backlog.release(len(prompt_ids))
            raise redis_unavailable() from None
        return await deliver(relay)
    finally:
        gw.router.unregister(responder.request_id)
        if enqueued:  # what the key used, finished or not (tenants' shares, billing)
            used = relay.usage()
            tokens = gw.metrics.key_tokens
            tokens.labels(key_id or "-", job.model.name, "prompt").inc(used["prompt_tokens"])
            tokens.labels(key_id or "-", job.model.name, "completion").inc(
                used["completion_tokens"]
            )
        if enqueued and not relay.finished:  # stop string, client gone, timeout: stop the work
            reason = STOP_STRING if relay.complete else "client_gone"
            gw.cancel_later(responder.request_id, reason)


def _priority(request: web.Request, parsed: CompletionRequest | ChatRequest) -> int:
    """The request's own priority, else its API key's default, else 0."""
    if parsed.priority is not None:
        return parsed.priority
    client = request.get(CLIENT)
    return 0 if client is None else client.priority


def _wire_sampling(parsed: CompletionRequest | ChatRequest, max_tokens: int) -> SamplingParams:
    """What the worker gets. Echo with max_tokens 0: one token (the wire's minimum), not shown;
    with logprobs, the prompt's own log-probs too."""
    echo = isinstance(parsed, CompletionRequest) and parsed.echo
    logprobs = parsed.sampling.logprobs
    return replace(
        parsed.sampling,
        max_tokens=max(max_tokens, 1),
        min_tokens=parsed.min_tokens,
        detokenize=False,
        grammar=parsed.grammar.text if parsed.grammar else None,
        prompt_logprobs=logprobs if echo and logprobs is not None else None,
    )


def _choices(
    model: ServedModel,
    parsed: CompletionRequest | ChatRequest,
    prompt_ids: list[int],
    sampling: SamplingParams,
    keep: bool,
) -> list[Choice]:
    """Per choice: its detokenizer, log-probs, tool-call parser and echo."""
    kind: Kind = "chat" if isinstance(parsed, ChatRequest) else "completion"
    names = _tool_names(parsed)
    echo = None
    if isinstance(parsed, CompletionRequest) and parsed.echo:
        text = parsed.prompt
        if not isinstance(text, str):
            text = model.decoder.decode(prompt_ids, skip_special_tokens=False)
        echo = text
    return [
        Choice(
            index=i,
            detok=IncrementalDetokenizer.create(model.decoder, prompt_ids, sampling.stop),
            logprobs=None if sampling.logprobs is None else LogprobsFormatter(kind, model.decoder),
            tools=None if names is None else ToolStream(names),
            echo=None if echo is None else Echo(echo, prompt_ids),
            hide_output=parsed.max_tokens == 0,
            keep=keep,
        )
        for i in range(sampling.n)
    ]


def _tool_names(parsed: CompletionRequest | ChatRequest) -> frozenset[str] | None:
    """The tools whose calls are read out of the output (None: no parsing). With another
    format forced (response_format), the output is that format, not calls."""
    if not isinstance(parsed, ChatRequest) or parsed.tools is None or not parsed.tools.offered:
        return None
    if parsed.grammar is not None and parsed.grammar.param not in ("tools", "tool_choice"):
        return None
    return parsed.tools.names


async def _prompt_ids(
    gw: Gateway, model: ServedModel, parsed: CompletionRequest | ChatRequest
) -> list[int]:
    if isinstance(parsed, ChatRequest) or isinstance(parsed.prompt, str):
        if isinstance(parsed, ChatRequest):
            messages, specs = tools.chat_input(
                parsed.messages, parsed.tools, model.template_has_tools
            )
            ids = await gw.registry.run(model.chat_ids, messages, specs)
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
    if num_prompt + max(max_tokens, 1) > limit:  # echo's max_tokens 0 still makes one
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for "
            f"the completion). Please reduce the prompt or max_tokens.",
            param=_param(parsed),
            code="context_length_exceeded",
        )
    return max_tokens
