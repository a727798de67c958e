"""The embeddings path: a request validated, tokenized, admitted, enqueued, and its vectors
collected.

An embedding is a prefill-only request on the same queue as generation: each input is an entry
of its own (`RequestMessage.embed`, `<id>-<i>` when there are several), read by the workers with
the same fair share (an entry costs its tokens and the one a prefill-only request is charged),
priorities, KV budget, preemption and takeover; its worker answers with one final reply that
carries the raw pooled vector. In order (nothing is enqueued before step 4; any error before it
is a 4xx or 503 with nothing left behind):
1. parse + validate the body (gateway.openai.embedding_models);
2. resolve the model (404), tokenize the texts on the tokenizer thread (token ids are checked
   against the vocabulary), each input within the context window, `dimensions` within the
   model's vector (400);
3. the backlog bound for the whole request (429, Retry-After);
4. XADD one entry per input, then wait for every final reply; leaving before them (client
   gone, timeout, an input that failed) cancels the inputs still running.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from gateway.openai.choices import NORMAL_FINISH
from gateway.openai.embedding_models import (
    EmbeddingRequest,
    embedding_body,
    embedding_item,
    finish_vector,
    parse_embedding,
)
from gateway.openai.errors import ApiError, bad_request
from gateway.serving import tracing
from gateway.serving.gateway_state import Gateway
from gateway.serving.queue_entries import QueueEntries
from gateway.serving.relay import EXPIRY_GRACE_S, final_error, idle_timeout_error
from gateway.serving.served_models import ServedModel
from generation import SamplingParams
from protocol import ProtocolError, ReplyMessage, RequestMessage, unpack_vector

# What an embedding entry carries as its sampling (a worker reads none of it; one token's worth
# is what the entry costs beyond its prompt, as the engine's pooling request is max_tokens 1).
EMBED_SAMPLING = SamplingParams(max_tokens=1, detokenize=False).to_dict()


@dataclass(frozen=True, slots=True)
class EmbeddingJob:
    """A request validated and tokenized: what is left is to admit and enqueue it."""

    parsed: EmbeddingRequest
    model: ServedModel
    inputs: list[list[int]]  # each input's token ids

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)

    @property
    def cost(self) -> int:
        """Tokens the request may use (what rate limits and fair share charge)."""
        return self.num_prompt_tokens + len(self.inputs)


async def prepare(gw: Gateway, body: dict[str, Any]) -> EmbeddingJob:
    """Steps 1-2: parse, resolve the model, tokenize, check the limits (4xx)."""
    parsed = parse_embedding(body)
    model = await gw.registry.resolve(parsed.model)
    inputs = await _token_ids(gw, model, parsed)
    limit = model.card.max_model_len
    for i, ids in enumerate(inputs):
        where = _where(i, len(inputs))
        if not ids:
            raise bad_request(f"{where}The input is empty after tokenization.", param="input")
        if len(ids) > limit:
            raise bad_request(
                f"{where}This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids)} tokens in the input for embedding. Please reduce the "
                "length of the input.",
                param="input",
                code="context_length_exceeded",
            )
    size = model.card.embedding_size
    if parsed.dimensions is not None and size and parsed.dimensions > size:
        raise bad_request(
            f"'dimensions' ({parsed.dimensions}) must be at most this model's embedding size "
            f"({size}).",
            param="dimensions",
        )
    return EmbeddingJob(parsed, model, inputs)


async def run(
    gw: Gateway, job: EmbeddingJob, priority: int, key_id: str | None, weight: int | None
) -> tuple[str, dict[str, Any]]:
    """Steps 3-4: the request id and the whole response body (or the ApiError it ended with)."""
    backlog = gw.backlog(job.model.name)
    await backlog.admit(job.num_prompt_tokens)  # from here to register(): no await (atomic)
    request_id = "embd-" + uuid.uuid4().hex
    queued = QueueEntries.register(gw, backlog, request_id, job.inputs, priority, key_id, weight)
    flights = queued.in_flight
    replies: asyncio.Queue[ReplyMessage] = asyncio.Queue()
    for flight in flights:
        flight.queue = replies  # before XADD: no reply can have arrived yet
    stream = backlog.queue(queued.queue)
    finals: dict[str, ReplyMessage] = {}
    now = time.time()
    timeout = gw.config.request_timeout

    async def xadd(i: int) -> None:
        # To the model's queue itself, with the request's span (gateway.serving.queue_entries
        # says how this differs from a generation entry).
        flight, ids = flights[i], job.inputs[i]
        message = RequestMessage(
            flight.request_id,
            job.model.name,
            ids,
            EMBED_SAMPLING,
            gw.reply_stream,
            gw.config.gateway_id,
            now,
            None if timeout is None else now + timeout,
            priority,
            key_id,
            embed=True,
            trace_context=tracing.carrier(),  # the request's span (None: tracing off)
            lora=job.model.adapter,
        )
        flight.request_stream = stream
        flight.entry_id = await backlog.enqueue(message, queued.queue, len(ids) + 1)

    try:
        await queued.send(xadd)
        await _collect(gw, len(flights), replies, finals)
        items = [
            embedding_item(i, _vector(finals[f.request_id], job.parsed), job.parsed.encoding_format)
            for i, f in enumerate(flights)
        ]
        return request_id, embedding_body(job.model.served_name, items, job.num_prompt_tokens)
    finally:
        # An input failed, client gone, timeout: stop the rest.
        queued.close(lambda i: None if flights[i].request_id in finals else "client_gone")
        if queued.sent:  # what the key used (tenants' shares, billing)
            used = sum(len(ids) for ids in job.inputs[: queued.sent])
            gw.metrics.key_tokens.labels(key_id or "-", job.model.served_name, "prompt").inc(used)


async def _collect(
    gw: Gateway,
    num_inputs: int,
    replies: asyncio.Queue[ReplyMessage],
    finals: dict[str, ReplyMessage],
) -> None:
    """Wait for every input's final reply (an input's only reply); the first that is not a
    normal finish ends the request with its error."""
    # A pooling request replies once, when it is done: however long it waited in the queue
    # (up to its deadline, when there is one) and however long its prompt takes.
    limit = gw.config.reply_idle_timeout_s
    if gw.config.request_timeout is not None:
        limit += gw.config.request_timeout + EXPIRY_GRACE_S
    while len(finals) < num_inputs:
        try:
            async with asyncio.timeout(limit):  # not wait_for (relay.next_reply says why)
                reply = await replies.get()
        except TimeoutError:
            raise idle_timeout_error() from None
        if not reply.is_final:
            continue  # a pooling request has nothing before its final
        finals[reply.request_id] = reply
        if reply.finish_reason not in NORMAL_FINISH:
            raise final_error(reply)


def _vector(reply: ReplyMessage, parsed: EmbeddingRequest) -> list[float]:
    """A final reply's vector as the client gets it. A reply without a readable one is the
    worker's failure (500); one shorter than `dimensions` is a 400 (the model's card did not
    say its size, so it could not be refused up front)."""
    try:
        raw = unpack_vector(reply.embedding or "")
    except ProtocolError:
        raw = []
    if not raw:
        raise ApiError(
            500, "The worker replied without an embedding.", "server_error", code="worker_error"
        )
    if parsed.dimensions is not None and parsed.dimensions > len(raw):
        raise bad_request(
            f"'dimensions' ({parsed.dimensions}) must be at most this model's embedding size "
            f"({len(raw)}).",
            param="dimensions",
        )
    return finish_vector(raw, parsed.dimensions, parsed.normalize)


async def _token_ids(gw: Gateway, model: ServedModel, parsed: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids: texts tokenized on the tokenizer thread (a list in one call),
    token ids checked against the vocabulary."""
    inputs = parsed.input
    if isinstance(inputs[0], str):
        return await gw.registry.run(_encode_all, model, inputs, parsed.add_special_tokens)
    for i, ids in enumerate(inputs):
        if max(ids) >= model.vocab_size:  # type: ignore[type-var]
            raise bad_request(
                f"{_where(i, len(inputs))}'input' holds token ids outside the vocabulary (size "
                f"{model.vocab_size}).",
                param="input",
            )
    return inputs  # type: ignore[return-value]


def _encode_all(model: ServedModel, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    if add_special_tokens:  # the very call /v1/completions makes
        return [model.encode(text) for text in texts]
    encode = partial(model.tokenizer.encode, add_special_tokens=False)
    return [list(encode(text)) for text in texts]


def _where(index: int, num_inputs: int) -> str:
    """What an error about one input starts with: nothing for a lone one."""
    return "" if num_inputs == 1 else f"input[{index}]: "
