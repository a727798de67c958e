"""Enqueue and reply: the request message, non-stream bodies, SSE streams, errors, disconnects."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient
from transformers import PreTrainedTokenizerFast

from protocol import STOP_STRING, CancelMessage, ReplyMessage, decode_replies
from tests.gateway.helpers import (
    KEYS,
    MODEL,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    eventually,
    replies_for,
    sse_events,
    tokens,
)

Client = TestClient[Any, Any]
INVALID = "invalid_request_error"


async def test_enqueued_chat_request_has_template_ids_and_sampling(
    client: Client, fake_worker: FakeWorker, tokenizer: PreTrainedTokenizerFast
) -> None:
    """Chat: prompt ids equal the tokenizer's own chat template ids; sampling fields travel."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 42,
        "stop": "\n",
        "ignore_eos": True,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "logit_bias": {"77": 5, "12": -100},
        "min_tokens": 2,
    }
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    request = await fake_worker.take()
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert request.prompt_token_ids == list(expected)
    assert request.model == MODEL and request.request_id.startswith("chatcmpl-")
    assert request.reply_to == KEYS.replies("gw-test") and request.gateway_id == "gw-test"
    assert request.deadline is None and request.enqueue_time > 0
    s = request.sampling_params
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (7, 0.5, 0.9, 20, 42)
    assert s.stop == ("\n",) and s.ignore_eos
    assert not s.detokenize  # workers send token ids; this gateway makes the text
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.25, 1.2)
    assert s.logit_bias == ((12, -100.0), (77, 5.0)) and s.min_tokens == 2
    await fake_worker.answer(request, ["Hi", " there"])
    response = await call
    assert response.status == 200
    out = await response.json()
    assert out["id"] == request.request_id and out["object"] == "chat.completion"
    assert out["model"] == MODEL and isinstance(out["created"], int)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert out["choices"][0]["finish_reason"] == "stop"
    n, m = len(expected), len(tokens("Hi")) + len(tokens(" there"))
    assert out["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": m,
        "total_tokens": n + m,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completion_defaults_and_token_id_prompt(
    client: Client, fake_worker: FakeWorker, tokenizer: PreTrainedTokenizerFast
) -> None:
    """A text prompt is encoded; a token-id prompt travels as is; max_tokens defaults to 16."""
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "the cat"}))
    request = await fake_worker.take()
    assert request.prompt_token_ids == tokenizer.encode("the cat")
    s = request.sampling_params
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (16, 1.0, 1.0, 0, None)
    await fake_worker.answer(request, ["a", "b", "c"], finish="length")
    out = await (await call).json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["text"] == "abc" and out["choices"][0]["finish_reason"] == "length"

    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": [5, 6, 7]}))
    request = await fake_worker.take()
    assert request.prompt_token_ids == [5, 6, 7]
    await fake_worker.answer(request, ["x"])
    assert (await (await call).json())["usage"]["prompt_tokens"] == 3


async def test_chat_stream_chunks_drop_duplicates_and_report_usage(
    client: Client, fake_worker: FakeWorker
) -> None:
    """SSE: role first, one content chunk per delta (duplicate seq dropped), finish, usage, DONE."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    request = await fake_worker.take()
    rid = request.request_id
    await fake_worker.reply(request, ReplyMessage(rid, 0, tokens("Hel")))
    await fake_worker.reply(request, ReplyMessage(rid, 0, tokens("Hel")))  # redelivered: dropped
    await fake_worker.reply(
        request,
        ReplyMessage(rid, 1, tokens("lo")),
        ReplyMessage(rid, 2, [], "", "stop", prompt_tokens=9, completion_tokens=2),
    )
    response = await call
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == rid and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:3]]
    assert contents == ["Hel", "lo"]
    assert chunks[3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[3]["choices"][0]["delta"] == {}
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"]["completion_tokens"] == 2
    assert chunks[4]["usage"]["total_tokens"] == 11
    assert len(chunks) == 5


async def test_completion_stream_text_chunks(client: Client, fake_worker: FakeWorker) -> None:
    """Completions SSE: choices[0].text per delta, a final chunk with finish_reason, DONE."""
    body = {"prompt": "x", "stream": True}
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    request = await fake_worker.take()
    await fake_worker.answer(request, ["a", "b"], finish="length")
    events = sse_events(await (await call).text())
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["a", "b", ""] and events[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, "length"]
    assert all("usage" not in e for e in events[:-1])


def _with_logprobs(reply: ReplyMessage) -> ReplyMessage:
    """What a worker sends for a request that asked for 2 alternatives: per token its log-prob
    (-0.5 - index in the reply) and two alternatives (itself, and "Z" at -3)."""
    z = tokens("Z")[0]
    reply.logprobs = [[-0.5 - i, [[t, -0.5 - i], [z, -3.0]]] for i, t in enumerate(reply.token_ids)]
    return reply


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_logprobs_in_openais_legacy_shape(
    client: Client, fake_worker: FakeWorker, stream: bool
) -> None:
    body = {"prompt": "x", "logprobs": 2, "stream": stream}
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    request = await fake_worker.take()
    assert request.sampling_params.logprobs == 2
    replies = [_with_logprobs(r) for r in replies_for(request, ["ab", "c"], finish="length")]
    await fake_worker.reply(request, *replies)
    response = await call
    if stream:
        events = sse_events(await response.text())
        parts = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"][0]["logprobs"]]
        logprobs = {key: [v for p in parts for v in p[key]] for key in parts[0]}
    else:
        logprobs = (await response.json())["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"]
    assert logprobs["token_logprobs"] == [-0.5, -1.5, -0.5]
    assert logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["top_logprobs"][0] == {"a": -0.5, "Z": -3.0}


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_in_openais_chat_shape(
    client: Client, fake_worker: FakeWorker, stream: bool
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "logprobs": True, "top_logprobs": 2, "stream": stream}
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    request = await fake_worker.take()
    assert request.sampling_params.logprobs == 2
    await fake_worker.reply(request, *[_with_logprobs(r) for r in replies_for(request, ["é"])])
    response = await call
    if stream:
        events = sse_events(await response.text())
        content = [
            entry
            for e in events[:-1]
            if e["choices"] and e["choices"][0]["logprobs"]
            for entry in e["choices"][0]["logprobs"]["content"]
        ]
    else:
        content = (await response.json())["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5, -1.5]  # "é" is two byte tokens
    assert content[0]["top_logprobs"][1] == {"token": "Z", "logprob": -3.0, "bytes": [90]}
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)


async def test_no_logprobs_unless_asked(client: Client, fake_worker: FakeWorker) -> None:
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
    request = await fake_worker.take()
    assert request.sampling_params.logprobs is None
    await fake_worker.answer(request, ["a"])
    assert (await (await call).json())["choices"][0]["logprobs"] is None


async def test_text_is_made_from_token_ids_with_characters_held_until_complete(
    client: Client, fake_worker: FakeWorker
) -> None:
    """Workers send token ids only. A character whose bytes span two replies is sent once it is
    whole; the deltas join to the full text, and any text the worker sends is not used."""
    body = {"prompt": "x", "stream": True}
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    request = await fake_worker.take()
    e_acute = tokens("é")
    assert len(e_acute) == 2  # two byte tokens
    rid = request.request_id
    await fake_worker.reply(
        request,
        ReplyMessage(rid, 0, tokens("caf") + e_acute[:1], text="ignored"),
        ReplyMessage(rid, 1, e_acute[1:] + tokens("!")),
        ReplyMessage(rid, 2, [], finish_reason="length", completion_tokens=6),
    )
    events = sse_events(await (await call).text())
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["caf", "é!", ""]


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_found_by_the_gateway_ends_the_reply_and_cancels_the_work(
    client: Client, fake_worker: FakeWorker, served: redis.Redis, stream: bool
) -> None:
    """The gateway detokenizes, so it finds stop strings: the text ends before the stop string
    (even one spanning two replies), finish_reason is "stop", the usage counts the tokens
    received, and a cancel with reason "stop" tells the worker to end the request."""
    body = {"prompt": "x", "stop": ["END"], "max_tokens": 40, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    request = await fake_worker.take()
    rid = request.request_id
    first, second = tokens("Hello E"), tokens("ND more")
    await fake_worker.reply(request, ReplyMessage(rid, 0, first), ReplyMessage(rid, 1, second))
    response = await call
    assert response.status == 200
    if stream:
        events = sse_events(await response.text())
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-2])
        reasons = [e["choices"][0]["finish_reason"] for e in events[:-2]]
        assert reasons[-1] == "stop" and not any(reasons[:-1])
        usage = events[-2]["usage"]
    else:
        out = await response.json()
        text, usage = out["choices"][0]["text"], out["usage"]
        assert out["choices"][0]["finish_reason"] == "stop"
    assert text == "Hello "
    assert usage["completion_tokens"] == len(first) + len(second)
    entries = await eventually(lambda: served.xrange(KEYS.cancels))
    cancel = CancelMessage.decode(entries[-1][1])
    assert (cancel.request_id, cancel.reason) == (rid, STOP_STRING)


async def test_worker_errors_map_to_http_errors(client: Client, fake_worker: FakeWorker) -> None:
    """Final error/abort/expired replies: 400/500/503/504 bodies, or an SSE error event."""
    cases = [
        (ReplyMessage("", 0, finish_reason="error", error="bad", error_type=INVALID), 400),
        (ReplyMessage("", 0, finish_reason="error", error="boom", error_type="server_error"), 500),
        (ReplyMessage("", 0, finish_reason="abort"), 503),
        (ReplyMessage("", 0, finish_reason="expired"), 504),
    ]
    for final, status in cases:
        call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
        request = await fake_worker.take()
        final.request_id = request.request_id
        await fake_worker.reply(request, final)
        response = await call
        assert response.status == status
        assert_openai_error(await response.json())

    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "stream": True}))
    request = await fake_worker.take()
    await fake_worker.reply(
        request,
        ReplyMessage(request.request_id, 0, tokens("par")),
        ReplyMessage(request.request_id, 1, finish_reason="error", error="oom", error_type="x"),
    )
    events = sse_events(await (await call).text())
    assert events[0]["choices"][0]["text"] == "par"
    assert events[1]["error"]["type"] == "server_error" and events[2] == "[DONE]"


async def test_a_gap_in_the_replies_ends_the_request_with_an_error_and_cancels_it(
    client: Client, fake_worker: FakeWorker, served: redis.Redis
) -> None:
    """Replies lost between a worker's publish and this gateway's read (Redis restarted without
    persistence) leave a gap in the seqs: the client gets a 503 (or an SSE error after the text
    it had), never a text with tokens missing, and the request's work is cancelled."""
    for stream in (False, True):
        body = {"prompt": "x", "stream": stream, "max_tokens": 40}
        call = asyncio.create_task(client.post("/v1/completions", json=body))
        request = await fake_worker.take()
        rid = request.request_id
        await fake_worker.reply(
            request,
            ReplyMessage(rid, 0, tokens("par")),
            ReplyMessage(rid, 2, tokens("ly")),  # seq 1 is gone
            ReplyMessage(rid, 3, [], "", "stop", prompt_tokens=1, completion_tokens=3),
        )
        response = await call
        if stream:
            events = sse_events(await response.text())
            assert events[0]["choices"][0]["text"] == "par"
            assert events[1]["error"]["code"] == "aborted" and events[2] == "[DONE]"
            assert "lost" in events[1]["error"]["message"] and len(events) == 3
        else:
            assert response.status == 503
            body = await response.json()
            assert_openai_error(body)
            assert body["error"]["code"] == "aborted" and "lost" in body["error"]["message"]
        entries = await eventually(lambda: served.xrange(KEYS.cancels))
        cancel = CancelMessage.decode(entries[-1][1])
        assert cancel.request_id == rid and cancel.reason == "replies_lost"


async def test_client_disconnect_publishes_cancel(
    client: Client, fake_worker: FakeWorker, served: redis.Redis
) -> None:
    """Client closes mid-stream: a CancelMessage on keys.cancels and the cancel flag is set."""
    body = {"prompt": "x", "stream": True, "max_tokens": 40}
    response = await client.post("/v1/completions", json=body)
    request = await fake_worker.take()
    await fake_worker.reply(request, ReplyMessage(request.request_id, 0, tokens("a")))
    assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
    response.close()  # the client goes away with the generation still running

    entries = await eventually(lambda: served.xrange(KEYS.cancels))
    cancel = CancelMessage.decode(entries[-1][1])
    assert cancel.request_id == request.request_id and cancel.reason == "client_gone"
    assert served.get(KEYS.cancelled(request.request_id)) is not None
    assert 0 < served.ttl(KEYS.cancelled(request.request_id)) <= 3600


async def test_non_stream_disconnect_publishes_cancel(
    client: Client, fake_worker: FakeWorker, served: redis.Redis
) -> None:
    """A non-streaming client that gives up waiting also cancels its request."""
    with_timeout = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
    request = await fake_worker.take()
    with_timeout.cancel()
    await asyncio.gather(with_timeout, return_exceptions=True)
    await eventually(lambda: served.exists(KEYS.cancelled(request.request_id)))


async def test_reply_stream_is_trimmed(client: Client, fake_worker: FakeWorker) -> None:
    """What the reader consumed is deleted: the reply stream stays empty between requests."""
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
    request = await fake_worker.take()
    await fake_worker.answer(request, ["a", "b", "c"])
    await call
    assert await eventually(lambda: _is_zero(fake_worker, request.reply_to))


async def test_an_in_flight_request_s_replies_stay_until_it_ends(
    client: Client, fake_worker: FakeWorker
) -> None:
    """The reply stream is the record a worker taking a request over reads back: what was read
    of a request still in flight is kept (and everything after it); once it ends, all goes."""
    slow = asyncio.create_task(client.post("/v1/completions", json={"prompt": "slow"}))
    first = await fake_worker.take()
    replies = replies_for(first, ["a", "b", "c"])
    await fake_worker.reply(first, *replies[:2])  # in flight: two replies read
    quick = asyncio.create_task(client.post("/v1/completions", json={"prompt": "quick"}))
    second = await fake_worker.take()
    await fake_worker.answer(second, ["x", "y"])
    await quick
    stream = fake_worker.io.client

    def kept() -> list[int]:
        entries = stream.xrange(first.reply_to)
        return [
            r.seq for _, f in entries for r in decode_replies(f) if r.request_id == first.request_id
        ]

    assert await asyncio.to_thread(kept) == [0, 1]
    await fake_worker.reply(first, replies[2])
    await slow
    assert await eventually(lambda: _is_zero(fake_worker, first.reply_to))


async def _is_zero(fake_worker: FakeWorker, key: str) -> bool:
    return await asyncio.to_thread(fake_worker.io.client.xlen, key) == 0


async def test_silent_workers_time_out_with_keepalives(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """No reply for reply_idle_timeout_s: 504 (or an SSE error event after keep-alive comments)
    and a cancel; the deadline travels when --request-timeout is set."""
    client = await make_client(reply_idle_timeout_s=0.4, sse_keepalive_s=0.1, request_timeout=30)
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
    request = await fake_worker.take()
    assert request.deadline is not None
    assert request.deadline - request.enqueue_time == pytest.approx(30)
    await fake_worker.reply(request, ReplyMessage(request.request_id, 0, tokens("a")))
    response = await call
    assert response.status == 504 and (await response.json())["error"]["code"] == "reply_timeout"
    await eventually(lambda: served.exists(KEYS.cancelled(request.request_id)))

    response = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    request = await fake_worker.take()
    await fake_worker.reply(request, ReplyMessage(request.request_id, 0, tokens("a")))
    raw = await response.text()
    assert ": keep-alive" in raw
    events = sse_events(raw)
    assert events[-2]["error"]["code"] == "reply_timeout" and events[-1] == "[DONE]"
    await eventually(lambda: served.exists(KEYS.cancelled(request.request_id)))
