"""Completions' `echo`: the prompt comes back before the completion, with the prompt's own
log-probs when `logprobs` is given, and `max_tokens: 0` returns the prompt alone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from protocol import ReplyMessage, RequestMessage
from tests.gateway.helpers import TOKENIZER, FakeWorker, replies_for, sse_events, tokens

Client = TestClient[Any, Any]
PROMPT = "the cat"


def token_text(token_id: int) -> str:
    return TOKENIZER.decode([token_id])


def prompt_logprobs(request: RequestMessage) -> list[list[Any]]:
    """What a worker sends for prompt_logprobs=1: per prompt token after the first, its log-prob
    (-1 - position) and one alternative ("Z")."""
    z = tokens("Z")[0]
    ids = request.prompt_token_ids
    return [[-1.0 - i, [[z, -0.1]]] for i in range(1, len(ids))]


def with_logprobs(reply: ReplyMessage) -> ReplyMessage:
    reply.logprobs = [[-0.5, [[t, -0.5]]] for t in reply.token_ids]
    return reply


async def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(
    client: Client, fake_worker: FakeWorker
) -> None:
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    request = await fake_worker.take()
    s = request.sampling_params
    assert (s.max_tokens, s.prompt_logprobs, s.logprobs) == (1, 1, 1)  # one token, not shown
    [final] = replies_for(request, ["!"], finish="length")
    final.prompt_logprobs = prompt_logprobs(request)
    await fake_worker.reply(request, with_logprobs(final))
    out = await (await call).json()
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    ids = request.prompt_token_ids
    texts = [token_text(t) for t in ids]
    assert logprobs["tokens"] == texts and "".join(texts) == PROMPT
    assert logprobs["token_logprobs"] == [None, *[-1.0 - i for i in range(1, len(ids))]]
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][1] == {"Z": -0.1}
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert logprobs["text_offset"] == offsets
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_comes_first_and_offsets_continue_after_it(
    client: Client, fake_worker: FakeWorker, stream: bool
) -> None:
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": stream}
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    request = await fake_worker.take()
    replies = [with_logprobs(r) for r in replies_for(request, [" sat", " down"], "length")]
    replies[0].prompt_logprobs = prompt_logprobs(request)
    await fake_worker.reply(request, *replies)
    response = await call
    if stream:
        events = sse_events(await response.text())
        assert events[0]["choices"][0]["text"] == PROMPT + " sat"  # the echo in the first chunk
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        parts = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"][0]["logprobs"]]
        logprobs = {key: [v for p in parts for v in p[key]] for key in parts[0]}
    else:
        choice = (await response.json())["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
    assert text == PROMPT + " sat down"
    n = len(request.prompt_token_ids)
    assert logprobs["token_logprobs"][n:] == [-0.5] * len(tokens(" sat down"))
    first_output = logprobs["text_offset"][n]
    assert first_output == len(PROMPT) and text[first_output:].startswith(logprobs["tokens"][n])


async def test_echo_without_logprobs_asks_for_no_prompt_logprobs(
    client: Client, fake_worker: FakeWorker
) -> None:
    call = asyncio.create_task(
        client.post("/v1/completions", json={"prompt": [40, 41], "echo": True})
    )
    request = await fake_worker.take()
    assert request.sampling_params.prompt_logprobs is None
    await fake_worker.answer(request, ["z"])
    out = await (await call).json()
    assert out["choices"][0]["text"] == token_text(40) + token_text(41) + "z"
    assert out["choices"][0]["logprobs"] is None


async def test_max_tokens_0_needs_echo(client: Client) -> None:
    response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert response.status == 400 and (await response.json())["error"]["param"] == "max_tokens"
