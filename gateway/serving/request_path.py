"""The request path: a generation request validated, tokenized, admitted, enqueued, relayed.

A request's life here, in order (nothing is enqueued until step 5; any error before it is a 4xx
or 503 with nothing left behind):
1. parse + validate the body (gateway.openai);             4. backlog bound (429, Retry-After);
2. resolve the model (404), tokenize on the tokenizer     5. XADD the RequestMessage, then send
   thread (chat template for chat);                          headers (stream) or wait (not);
3. prompt + max_tokens within max_model_len, a grammar     6. relay replies until every
   that compiles (400);                                      choice ended (gateway.serving.relay).
A completions list of prompts is one entry per prompt in step 5, the steps before taking each
prompt in turn (an error names it) and the request as a whole (admitted on its summed tokens).
Leaving before the final reply (client gone, idle timeout, error) publishes a cancel.
Steps 1-3 are `prepare`, 4-6 `submit`: the HTTP routes (gateway.http.completion_routes) and a
Batch API line (gateway.batch.line_runner) take the same path.

Workers send token ids; the text is made in the gateway (gateway.openai.choices, one detokenizer
per choice), so it costs the workers' steps nothing and the gateways, which scale out, pay it. A
stop string found there ends its choice at once and cancels the rest of its work (the worker
stops within a step or two).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from gateway.openai import tools
from gateway.openai.choices import Choice, Echo
from gateway.openai.completion_bodies import Kind, Responder
from gateway.openai.errors import bad_request
from gateway.openai.logprobs_format import LogprobsFormatter
from gateway.openai.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from gateway.openai.structured_outputs import Grammar, compile_error
from gateway.openai.tool_parser import ToolStream
from gateway.serving import tracing
from gateway.serving.gateway_state import Gateway
from gateway.serving.queue_entries import QueueEntries
from gateway.serving.relay import PromptEntry, Relay
from gateway.serving.served_models import ServedModel
from generation import SamplingParams
from generation.detokenizer import IncrementalDetokenizer
from protocol import STOP_STRING, RequestMessage

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Job:
    """A request validated and tokenized: what is left is to admit and enqueue it."""

    kind: Kind
    parsed: GenerationRequest
    model: ServedModel
    prompts: list[list[int]]  # each prompt's token ids (a completions list: several)
    sampling: SamplingParams

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    def prompt_cost(self, prompt_ids: list[int]) -> int:
        """Tokens one prompt's entry may use: the prompt, and max_tokens for every choice."""
        return len(prompt_ids) + self.sampling.n * self.sampling.max_tokens

    @property
    def cost(self) -> int:
        """Tokens the request may use: every prompt's cost (what rate limits charge)."""
        return sum(self.prompt_cost(ids) for ids in self.prompts)


async def prepare(gw: Gateway, kind: Kind, body: dict[str, Any]) -> Job:
    """Steps 1-3: parse, resolve the model, tokenize, check limits and the grammar (4xx)."""
    with tracing.span("jitney.parse", **{tracing.KIND: kind}):
        parsed = parse_chat(body) if kind == "chat" else parse_completion(body)
    return await prepare_parsed(gw, kind, parsed)


async def prepare_parsed(gw: Gateway, kind: Kind, parsed: GenerationRequest) -> Job:
    """Steps 2-3 for a request parsed already (the Responses API's, made into a chat)."""
    _check_num_prompts(gw, parsed)
    model = await gw.registry.resolve(parsed.model)
    tracing.annotate(**{tracing.MODEL: model.served_name})
    with tracing.span("jitney.tokenize") as span:
        prompts = await _prompts(gw, model, parsed)
        tracing.set_attributes(span, prompts=len(prompts), prompt_tokens=sum(map(len, prompts)))
    # The model's sampling defaults fill the fields the request did not send.
    parsed = model.with_defaults(parsed, prompts)
    # Every prompt fits with the same max_tokens (the completions default does not depend on
    # the prompt; a chat has one prompt).
    max_tokens = min(
        _max_tokens(gw, model, parsed, len(ids), _where(i, len(prompts)))
        for i, ids in enumerate(prompts)
    )
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
    prediction = await _prediction_ids(gw, model, parsed)
    grammar = parsed.grammar
    if grammar is not None:  # compiled now: a bad one is a 400 before anything queues
        if kind == "chat":  # for the content only (after any reasoning: a reasoning parser's)
            grammar = replace(grammar, text=model.content_grammar(grammar.text, prompts[0]))
        error = await gw.registry.run(model.grammar_error, grammar.text)
        if error is not None:
            raise compile_error(grammar, error)
    sampling = _wire_sampling(parsed, max_tokens, grammar, prediction)
    return Job(kind, parsed, model, prompts, sampling)


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
    batch line's body). Leaving before the final reply cancels the work.

    Each prompt is a queue entry of its own (its own request id, `<id>-<i>` when there are
    several), so fair share, priorities and cancellation act per prompt; the request is
    admitted or refused whole, its prompts' tokens together."""
    parsed = job.parsed
    backlog = gw.backlog(job.model.name)
    await backlog.admit(job.num_prompt_tokens)  # from here to register(): no await (atomic)

    responder = Responder(job.kind, job.model.served_name, parsed.include_usage, id=request_id)
    queued = QueueEntries.register(
        gw, backlog, responder.request_id, job.prompts, priority, key_id, weight
    )
    entries = [
        PromptEntry(flight.request_id, flight, _choices(job, i, keep=not parsed.stream), len(ids))
        for i, (flight, ids) in enumerate(zip(queued.in_flight, job.prompts, strict=True))
    ]
    relay = Relay(gw, job.model, responder, entries, received)
    now = time.time()

    async def xadd(i: int) -> None:
        entry, prompt_ids = entries[i], job.prompts[i]
        with tracing.enqueue_span(entry.request_id) as span:
            message = _message(gw, job, entry.request_id, prompt_ids, now, priority, key_id)
            cost = job.prompt_cost(prompt_ids)
            # On the worker holding the prompt's start, when placement finds one.
            stream, entry_id = await backlog.place(message, queued.queue, cost)
            tracing.set_attributes(span, **{tracing.STREAM: stream})
        entry.in_flight.request_stream, entry.in_flight.entry_id = stream, entry_id

    def cancel_reason(i: int) -> str | None:  # stop string, client gone, timeout, another failed
        entry = entries[i]
        if entry.finished:
            return None
        return STOP_STRING if entry.complete else "client_gone"

    try:
        await queued.send(xadd)
        return await deliver(relay)
    finally:
        queued.close(cancel_reason)
        if queued.sent:  # what the key used, finished or not (tenants' shares, billing)
            used, model = relay.usage(), job.model.served_name  # an adapter's usage is its own
            tokens = gw.metrics.key_tokens
            tokens.labels(key_id or "-", model, "prompt").inc(used["prompt_tokens"])
            tokens.labels(key_id or "-", model, "completion").inc(used["completion_tokens"])


def _message(
    gw: Gateway,
    job: Job,
    request_id: str,
    prompt_ids: list[int],
    now: float,
    priority: int,
    key_id: str | None,
) -> RequestMessage:
    timeout = gw.config.request_timeout
    return RequestMessage(
        request_id=request_id,
        model=job.model.name,
        prompt_token_ids=prompt_ids,
        sampling=job.sampling.to_dict(),
        reply_to=gw.reply_stream,
        gateway_id=gw.config.gateway_id,
        enqueue_time=now,
        deadline=None if timeout is None else now + timeout,
        priority=priority,
        key_id=key_id,
        trace_context=tracing.carrier(),  # the enqueue span's: the worker's spans continue it
        lora=job.model.adapter,
    )


def _check_num_prompts(gw: Gateway, parsed: GenerationRequest) -> None:
    if isinstance(parsed, ChatCompletionRequest):
        return
    limit = gw.config.max_prompts_per_request
    if len(parsed.prompts) > limit:
        raise bad_request(
            f"'prompt' holds {len(parsed.prompts)} prompts; at most {limit} are accepted in one "
            "request.",
            param="prompt",
        )


def _wire_sampling(
    parsed: GenerationRequest, max_tokens: int, grammar: Grammar | None, prediction: list[int]
) -> SamplingParams:
    """What the worker gets. Echo with max_tokens 0: one token (the wire's minimum), not shown;
    with logprobs, the prompt's own log-probs too."""
    echo = isinstance(parsed, CompletionRequest) and parsed.echo
    logprobs = parsed.sampling.logprobs
    return replace(
        parsed.sampling,
        max_tokens=max(max_tokens, 1),
        min_tokens=parsed.min_tokens,
        detokenize=False,
        grammar=grammar.text if grammar else None,
        prompt_logprobs=logprobs if echo and logprobs is not None else None,
        prediction_token_ids=tuple(prediction),
    )


async def _prediction_ids(gw: Gateway, model: ServedModel, parsed: GenerationRequest) -> list[int]:
    """The request's `prediction` as token ids (no special tokens: it is reply text), refused
    (400) past the context window, which no reply outgrows; [] without one."""
    if parsed.prediction is None:
        return []
    text = parsed.prediction.text
    ids = await gw.registry.run(model.encode_text, text)
    limit = model.card.max_model_len
    if len(ids) > limit:
        raise bad_request(
            f"'prediction' holds {len(ids)} tokens; at most the context window, {limit}.",
            param="prediction",
        )
    return ids


def _choices(job: Job, prompt: int, keep: bool) -> list[Choice]:
    """The choices of prompt `prompt`, indices prompt * n .. prompt * n + n - 1 (OpenAI's
    order): each with its detokenizer, log-probs, tool-call parser and echo."""
    parsed, model, sampling = job.parsed, job.model, job.sampling
    prompt_ids = job.prompts[prompt]
    kind: Kind = "chat" if isinstance(parsed, ChatCompletionRequest) else "completion"
    names = _tool_names(parsed)
    echo = None
    if isinstance(parsed, CompletionRequest) and parsed.echo:
        text = parsed.prompts[prompt]
        if not isinstance(text, str):
            text = model.decoder.decode(prompt_ids, skip_special_tokens=False)
        echo = text
    return [
        Choice(
            index=prompt * sampling.n + i,
            detok=IncrementalDetokenizer.create(model.decoder, prompt_ids, sampling.stop),
            logprobs=None if sampling.logprobs is None else LogprobsFormatter(kind, model.decoder),
            tools=None if names is None else ToolStream(names),
            reasoning=model.reasoning_stream(prompt_ids) if kind == "chat" else None,
            echo=None if echo is None else Echo(echo, prompt_ids),
            hide_output=parsed.max_tokens == 0,
            keep=keep,
        )
        for i in range(sampling.n)
    ]


def _tool_names(parsed: GenerationRequest) -> frozenset[str] | None:
    """The tools whose calls are read out of the output (None: no parsing). With another
    format forced (response_format), the output is that format, not calls."""
    if not isinstance(parsed, ChatCompletionRequest):
        return None
    config = parsed.tool_config
    if config is None or not config.offered:
        return None
    if parsed.grammar is not None and parsed.grammar.param not in ("tools", "tool_choice"):
        return None
    return config.names


async def _prompts(gw: Gateway, model: ServedModel, parsed: GenerationRequest) -> list[list[int]]:
    """Each prompt's token ids (texts tokenized on the tokenizer thread, a list in one call),
    refused (400) when empty or outside the vocabulary; with several, the error names which."""
    if isinstance(parsed, ChatCompletionRequest):
        messages, specs = tools.chat_input(
            parsed.template_messages(), parsed.tool_config, model.template_has_tools
        )
        kwargs = parsed.chat_template_kwargs  # the client's, to the template
        prompts = [await gw.registry.run(model.chat_ids, messages, specs, kwargs)]
    elif isinstance(parsed.prompts[0], str):
        prompts = await gw.registry.run(_encode_all, model, parsed.prompts)
    else:  # token ids, never empty (the request model): only the vocabulary is left to check
        prompts = [ids for ids in parsed.prompts if isinstance(ids, list)]
        for i, ids in enumerate(prompts):
            if max(ids) >= model.vocab_size:
                raise bad_request(
                    f"{_where(i, len(prompts))}'prompt' holds token ids outside the vocabulary "
                    f"(size {model.vocab_size}).",
                    param="prompt",
                )
    for i, ids in enumerate(prompts):
        if not ids:
            raise bad_request(
                f"{_where(i, len(prompts))}The prompt is empty after tokenization.",
                param=_param(parsed),
            )
    return prompts


def _encode_all(model: ServedModel, texts: list[str]) -> list[list[int]]:
    return [model.encode(text) for text in texts]


def _where(index: int, num_prompts: int) -> str:
    """What an error about one prompt starts with: nothing for a lone one."""
    return "" if num_prompts == 1 else f"prompt[{index}]: "


def _param(parsed: GenerationRequest) -> str:
    return "messages" if isinstance(parsed, ChatCompletionRequest) else "prompt"


def _max_tokens(
    gw: Gateway, model: ServedModel, parsed: GenerationRequest, num_prompt: int, where: str = ""
) -> int:
    """The client's max_tokens or the route's default, refused (400) past the context window
    (`where`: which prompt, the error's first words)."""
    limit = model.card.max_model_len
    max_tokens = parsed.max_tokens
    if max_tokens is None:  # chat: as much as fits, capped; completions: OpenAI's 16
        if isinstance(parsed, ChatCompletionRequest):
            max_tokens = max(1, min(gw.config.chat_default_max_tokens, limit - num_prompt))
        else:
            max_tokens = gw.config.completion_default_max_tokens
    if num_prompt + max(max_tokens, 1) > limit:  # echo's max_tokens 0 still makes one
        raise bad_request(
            f"{where}This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for "
            f"the completion). Please reduce the prompt or max_tokens.",
            param=_param(parsed),
            code="context_length_exceeded",
        )
    return max_tokens
