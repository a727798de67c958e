"""n > 1: one request, several choices sharing the prompt. Replies carry their choice's index;
the response has every choice with its index, the usage counts the prompt once, and a stop
string in one choice ends (and cancels) that choice only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient

from protocol import STOP_STRING, CancelMessage, ReplyMessage, RequestMessage
from tests.gateway.helpers import (
    KEYS,
    FakeWorker,
    assert_openai_error,
    eventually,
    replies_for,
    sse_events,
    tokens,
)

Client = TestClient[Any, Any]
TEXTS = ["red", "green", "blue"]


def interleaved(request: RequestMessage, texts: list[str]) -> list[ReplyMessage]:
    """Each choice's text in two replies, the choices taking turns; seq counts across them."""
    per_choice = [replies_for(request, [t[:2], t[2:]], index=i) for i, t in enumerate(texts)]
    replies = [r for pair in zip(*per_choice, strict=True) for r in pair]
    for seq, reply in enumerate(replies):
        reply.seq = seq
        if reply.is_final:
            reply.cached_tokens = 2
    return replies


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_n_choices_in_one_body(client: Client, fake_worker: FakeWorker, route: str) -> None:
    body: dict[str, Any] = {"n": 3, "temperature": 0}  # identical choices are allowed
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "colour?"}]
    else:
        body |= {"prompt": "colour?", "best_of": 3}
    call = asyncio.create_task(client.post(route, json=body))
    request = await fake_worker.take()
    assert request.sampling_params.n == 3
    await fake_worker.reply(request, *interleaved(request, TEXTS))
    out = await (await call).json()
    texts = [c.get("text") or c.get("message", {}).get("content") for c in out["choices"]]
    assert texts == TEXTS and [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "stop" for c in out["choices"])
    prompt = len(request.prompt_token_ids)
    completion = sum(len(tokens(t)) for t in TEXTS)
    assert out["usage"] == {
        "prompt_tokens": prompt,  # once, not per choice
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


async def test_n_choices_streamed_with_their_indices(
    client: Client, fake_worker: FakeWorker
) -> None:
    body = {
        "messages": [{"role": "user", "content": "colour?"}],
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    request = await fake_worker.take()
    await fake_worker.reply(request, *interleaved(request, TEXTS))
    events = sse_events(await (await call).text())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": ""}
    ] * 3
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    for i, text in enumerate(TEXTS):
        mine = [c["choices"][0] for c in chunks[3:] if c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == text
        assert [c["finish_reason"] for c in mine][-1] == "stop"
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == []
    assert usage["completion_tokens"] == sum(len(tokens(t)) for t in TEXTS)
    assert usage["prompt_tokens"] == len(request.prompt_token_ids)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_in_one_choice_cancels_that_choice_only(
    client: Client, fake_worker: FakeWorker, served: redis.Redis, stream: bool
) -> None:
    body = {"prompt": "x", "n": 3, "stop": ["END"], "max_tokens": 30, "stream": stream}
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    request = await fake_worker.take()
    rid = request.request_id
    await fake_worker.reply(
        request,
        ReplyMessage(rid, 0, tokens("a"), index=0),
        ReplyMessage(rid, 1, tokens("bb END more"), index=1),
    )
    entries = await eventually(lambda: served.xrange(KEYS.cancels))
    cancel = CancelMessage.decode(entries[-1][1])
    assert (cancel.request_id, cancel.reason, cancel.index) == (rid, STOP_STRING, 1)
    assert not served.exists(KEYS.cancelled(rid))  # the flag would drop the whole request
    # The worker ends choice 1 (it read the cancel), and the others go on to their ends.
    rest = [
        ReplyMessage(rid, 2, tokens(" x"), index=1, finish_reason="stop", completion_tokens=9),
        ReplyMessage(rid, 3, tokens("c"), index=2),
        ReplyMessage(rid, 4, tokens("a"), index=0, finish_reason="length", completion_tokens=2),
        ReplyMessage(rid, 5, tokens("c"), index=2, finish_reason="stop", completion_tokens=2),
    ]
    await fake_worker.reply(request, *rest)
    response = await call
    if stream:
        events = sse_events(await response.text())[:-1]
        texts = [
            "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i)
            for i in range(3)
        ]
        reasons = [
            e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]
        ]
        assert sorted(reasons) == ["length", "stop", "stop"]
    else:
        out = await response.json()
        texts = [c["text"] for c in out["choices"]]
        assert [c["finish_reason"] for c in out["choices"]] == ["length", "stop", "stop"]
        # choice 1 counts the tokens received up to its stop string, not the worker's count
        assert out["usage"]["completion_tokens"] == 2 + len(tokens("bb END more")) + 2
    assert texts == ["aa", "bb ", "cc"]
    assert len(served.xrange(KEYS.cancels)) == 1  # every choice ended: nothing more to cancel


async def test_an_error_in_one_choice_fails_the_request(
    client: Client, fake_worker: FakeWorker
) -> None:
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "n": 2}))
    request = await fake_worker.take()
    rid = request.request_id
    await fake_worker.reply(
        request,
        *replies_for(request, ["ok"], index=0),
        ReplyMessage(rid, 1, index=1, finish_reason="error", error="boom", error_type="x"),
    )
    response = await call
    assert response.status == 500
    assert_openai_error(await response.json())


@pytest.mark.parametrize("best_of", [1, 4])
async def test_best_of_other_than_n_is_refused(client: Client, best_of: int) -> None:
    body = {"prompt": "x", "n": 2, "best_of": best_of}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 400
    assert_openai_error(await response.json(), "best_of")
