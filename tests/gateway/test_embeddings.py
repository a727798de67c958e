"""POST /v1/embeddings with the test playing the worker: one prefill-only queue entry per input,
the vectors in input order, normalised, truncated to `dimensions`, as floats or base64, and
every bad input a 400 naming the field with nothing enqueued; an input that fails ends the
request and cancels the others, as a client that leaves does."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from dataclasses import replace
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient

from gateway.config import ApiKey
from protocol import (
    CancelMessage,
    ModelCard,
    ProtocolError,
    ReplyMessage,
    RequestMessage,
    pack_vector,
    unpack_vector,
)
from tests.gateway.helpers import (
    KEYS,
    MODEL,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    enqueued_total,
    eventually,
    publish_card,
    tokens,
)

Client = TestClient[Any, Any]
EMBEDDINGS = "/v1/embeddings"
SIZE = 4  # the card's embedding size
TEXTS = ["red", "a longer blue", "green"]


@pytest.fixture
def sized(served: redis.Redis, card: ModelCard) -> redis.Redis:
    """The model's card says how long its vectors are."""
    publish_card(served, replace(card, embedding_size=SIZE))
    return served


def raw_vector(i: int) -> list[float]:
    return [float(i + 1), 2.0, -2.0, 1.0]


def final(request: RequestMessage, vector: list[float] | None) -> ReplyMessage:
    """An embedding's only reply, as a worker sends it: final, with the raw vector."""
    return ReplyMessage(
        request.request_id,
        0,
        finish_reason="stop",
        prompt_tokens=len(request.prompt_token_ids),
        embedding=None if vector is None else pack_vector(vector),
    )


def normalized(values: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


async def take_in_order(worker: FakeWorker, count: int) -> list[RequestMessage]:
    requests = [await worker.take() for _ in range(count)]
    return sorted(requests, key=lambda r: r.request_id)


async def test_each_input_is_a_prefill_only_entry_and_vectors_come_in_order(
    client: Client, fake_worker: FakeWorker, sized: redis.Redis
) -> None:
    body = {"input": TEXTS, "priority": 3, "user": "someone"}
    call = asyncio.create_task(client.post(EMBEDDINGS, json=body))
    requests = await take_in_order(fake_worker, len(TEXTS))
    costs = {
        json.loads(fields[b"m"])["request_id"]: int(fields[b"c"])
        for _, fields in sized.xrange(KEYS.requests(MODEL, 3))
    }
    for i, (request, text) in enumerate(zip(requests, TEXTS, strict=True)):
        assert request.embed and request.request_id.endswith(f"-{i}")
        assert request.prompt_token_ids == tokens(text) and request.priority == 3
        assert request.sampling_params.max_tokens == 1
        assert costs[request.request_id] == len(tokens(text)) + 1  # its prompt and one token
    for i, request in reversed(list(enumerate(requests))):  # answered last first
        await fake_worker.reply(request, final(request, raw_vector(i)))
    response = await call
    assert response.status == 200
    out = await response.json()
    assert response.headers["X-Request-Id"] == requests[0].request_id.rsplit("-", 1)[0]
    assert response.headers["X-Request-Id"].startswith("embd-")
    assert out["object"] == "list" and out["model"] == "tiny"
    assert [(d["object"], d["index"]) for d in out["data"]] == [("embedding", i) for i in range(3)]
    for i, item in enumerate(out["data"]):
        assert item["embedding"] == pytest.approx(normalized(raw_vector(i)), abs=1e-7)
    prompt = sum(len(tokens(t)) for t in TEXTS)
    assert out["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt}


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({}, [v / 5 for v in (3.0, 0.0, 4.0, 0.0)]),
        ({"dimensions": 2}, [1.0, 0.0]),  # truncated, then normalised again (Matryoshka)
        ({"normalize": False}, [3.0, 0.0, 4.0, 0.0]),
        ({"dimensions": 3, "normalize": False}, [3.0, 0.0, 4.0]),
    ],
)
async def test_base64_is_the_float_body_s_values_as_little_endian_float32(
    client: Client, fake_worker: FakeWorker, sized: redis.Redis, fields: dict, want: list[float]
) -> None:
    bodies = {}
    for fmt in ("float", "base64"):
        body = {"input": [5, 6, 7], "encoding_format": fmt, **fields}
        call = asyncio.create_task(client.post(EMBEDDINGS, json=body))
        request = await fake_worker.take()
        await fake_worker.reply(request, final(request, [3.0, 0.0, 4.0, 0.0]))
        response = await call
        assert response.status == 200, await response.text()
        bodies[fmt] = (await response.json())["data"][0]["embedding"]
    raw = base64.b64decode(bodies["base64"])
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert decoded == bodies["float"]  # exactly: both are the same float32 values
    assert decoded == pytest.approx(want, abs=1e-7)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, "input", "'input' is required."),
        ({"input": ""}, "input", "'input' must not be an empty string."),
        ({"input": []}, "input", "'input' must not be empty."),
        ({"input": ["a", ""]}, "input", "'input[1]' must not be an empty string."),
        ({"input": [[5], []]}, "input", "'input[1]' must not be empty."),
        ({"input": [[5], [-1]]}, "input", "'input[1]' must be a list of integers between 0 and"),
        ({"input": [True]}, "input", "'input' must be a list of integers between 0 and"),
        ({"input": [5, "a"]}, "input", "'input' must be a string, a list of strings, a list"),
        ({"input": 5}, "input", "'input' must be a string, a list of strings, a list"),
        ({"input": {"a": 1}}, "input", "'input' must be a string, a list of strings, a list"),
        ({"input": ["x"] * 2049}, "input", "'input' holds 2049 inputs; at most 2048"),
        ({"input": "x" * 80}, "input", "This model's maximum context length is 64 tokens. Howe"),
        ({"input": ["ok", "x" * 80]}, "input", "input[1]: This model's maximum context length"),
        ({"input": [[5], [5, 100_000]]}, "input", "input[1]: 'input' holds token ids outside"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'encoding_format' must"),
        ({"input": "a", "dimensions": 0}, "dimensions", "'dimensions' must be at least 1."),
        ({"input": "a", "dimensions": "2"}, "dimensions", "'dimensions' must be an integer."),
        ({"input": "a", "dimensions": 5}, "dimensions", "'dimensions' (5) must be at most this"),
        ({"input": "a", "user": 7}, "user", "'user' must be a string."),
        ({"input": "a", "priority": 100}, "priority", "'priority' must be between -100 and 99."),
        ({"input": "a", "normalize": "yes"}, "normalize", "'normalize' must be a boolean."),
    ],
)
async def test_a_bad_input_is_a_400_naming_it_and_nothing_is_enqueued(
    client: Client, sized: redis.Redis, body: dict, param: str, words: str
) -> None:
    response = await client.post(EMBEDDINGS, json=body)
    assert response.status == 400, await response.text()
    out = await response.json()
    assert_openai_error(out, param)
    assert out["error"]["message"].startswith(words), out
    assert enqueued_total(sized) == 0


async def test_an_over_long_input_names_its_token_count(client: Client, sized: redis.Redis):
    response = await client.post(EMBEDDINGS, json={"input": list(range(5, 70))})
    error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded"
    assert "64 tokens" in error["message"] and "65 tokens in the input" in error["message"]


async def test_an_unknown_model_is_a_404(client: Client, sized: redis.Redis) -> None:
    response = await client.post(EMBEDDINGS, json={"input": "a", "model": "other"})
    assert response.status == 404
    assert enqueued_total(sized) == 0


def cancelled(r: redis.Redis) -> set[str]:
    return {CancelMessage.decode(f).request_id for _, f in r.xrange(KEYS.cancels)}


async def test_a_failed_input_fails_the_request_and_cancels_the_others(
    client: Client, fake_worker: FakeWorker, sized: redis.Redis
) -> None:
    call = asyncio.create_task(client.post(EMBEDDINGS, json={"input": TEXTS}))
    first, failing, third = await take_in_order(fake_worker, 3)
    await fake_worker.reply(first, final(first, raw_vector(0)))
    await fake_worker.reject(failing, "error", error="too long", error_type="invalid_request_error")
    response = await call
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "worker_rejected"
    await eventually(lambda: third.request_id in cancelled(sized))
    assert cancelled(sized) == {third.request_id}  # the finished and the failed need none


async def test_a_client_gone_cancels_every_input_s_entry(
    client: Client, fake_worker: FakeWorker, sized: redis.Redis
) -> None:
    call = asyncio.create_task(client.post(EMBEDDINGS, json={"input": TEXTS[:2]}))
    requests = await take_in_order(fake_worker, 2)
    await fake_worker.reply(requests[0], final(requests[0], raw_vector(0)))
    call.cancel()  # the client goes away while the second is still running
    await eventually(lambda: sized.exists(KEYS.cancelled(requests[1].request_id)))
    assert sized.get(KEYS.cancelled(requests[1].request_id)) == b"client_gone"
    assert not sized.exists(KEYS.cancelled(requests[0].request_id))


@pytest.mark.parametrize(("vector", "status"), [(None, 500), ([1.0, 0.0], 400)])
async def test_a_reply_without_the_vector_asked_for_is_an_error_not_a_crash(
    client: Client, fake_worker: FakeWorker, served: redis.Redis, vector, status
) -> None:
    """No vector: the worker's fault (500). A card that does not say the size (0) cannot
    refuse `dimensions` up front: a vector shorter than it is refused when it comes."""
    call = asyncio.create_task(client.post(EMBEDDINGS, json={"input": "a", "dimensions": 3}))
    request = await fake_worker.take()
    await fake_worker.reply(request, final(request, vector))
    response = await call
    assert response.status == status
    out = await response.json()
    assert_openai_error(out)
    if status == 400:
        assert out["error"]["param"] == "dimensions" and "(2)" in out["error"]["message"]


async def test_an_api_key_s_priority_and_share_apply(
    sized: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """A key's default priority and fair-share weight put its embeddings in its own queue, as
    its generation requests go."""
    client = await make_client(api_keys=(ApiKey("team", "key-team", priority=4, weight=2),))
    headers = {"Authorization": "Bearer key-team"}
    call = asyncio.create_task(client.post(EMBEDDINGS, json={"input": "a"}, headers=headers))
    request = await fake_worker.take()
    assert (request.priority, request.key_id, request.embed) == (4, "team", True)
    assert fake_worker.entries[request.request_id].queue == KEYS.requests("tiny", 4, "team")
    await fake_worker.reply(request, final(request, raw_vector(0)))
    assert (await call).status == 200


def test_a_vector_on_the_wire_is_exact_float32_and_garbage_is_refused() -> None:
    values = [0.1, -2.5, 3.0e-8, 1.0e30]
    text = pack_vector(values)
    assert base64.b64decode(text) == struct.pack("<4f", *values)  # OpenAI's base64 bytes
    assert unpack_vector(text) == list(struct.unpack("<4f", struct.pack("<4f", *values)))
    for bad in ("not base64!", base64.b64encode(b"12345").decode()):
        with pytest.raises(ProtocolError):
            unpack_vector(bad)
