"""LoRA adapters named as models, with the test playing the worker: /v1/models lists each one
with its base as parent; every route enqueues a request naming one on its base model's queue
with `lora` set, and answers under the adapter's name; tokenizing uses the base tokenizer; an
unknown name stays the 404 model error."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient

from protocol import ModelCard, ReplyMessage, pack_vector
from tests.gateway.helpers import (
    MODEL,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    publish_card,
    replies_for,
    tokens,
)
from tests.gateway.test_batches import FAST, create_batch, file_lines, jsonl, line, wait_status

Client = TestClient[Any, Any]
ADAPTER = "tiny-sql"


@pytest.fixture
def with_adapter(served: redis.Redis, card: ModelCard) -> redis.Redis:
    """The worker's card says it serves ADAPTER beside the model."""
    publish_card(served, replace(card, adapters=[ADAPTER], embedding_size=2))
    return served


async def test_models_lists_each_adapter_with_its_base_as_parent(
    client: Client, with_adapter: redis.Redis
) -> None:
    listed = {m["id"]: m for m in (await (await client.get("/v1/models")).json())["data"]}
    assert set(listed) == {MODEL, ADAPTER}
    assert listed[MODEL]["parent"] is None and listed[MODEL]["root"] == MODEL
    adapter = listed[ADAPTER]
    assert adapter["object"] == "model" and adapter["parent"] == MODEL
    assert adapter["root"] == ADAPTER
    assert adapter["max_model_len"] == listed[MODEL]["max_model_len"]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", CHAT),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "store": False}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=["completions", "chat", "responses"])
async def test_a_request_naming_an_adapter_runs_on_the_base_queue_under_it(
    client: Client, fake_worker: FakeWorker, with_adapter: redis.Redis, path: str, body: dict
) -> None:
    call = asyncio.create_task(client.post(path, json={**body, "model": ADAPTER}))
    request = await fake_worker.take()  # from the base model's queue
    assert request.model == MODEL and request.lora == ADAPTER
    await fake_worker.answer(request, ["o", "k"])
    response = await call
    assert response.status == 200, await response.text()
    assert (await response.json())["model"] == ADAPTER


async def test_the_base_model_runs_under_no_adapter(
    client: Client, fake_worker: FakeWorker, with_adapter: redis.Redis
) -> None:
    call = asyncio.create_task(client.post("/v1/completions", json=ROUTES[0][1]))
    request = await fake_worker.take()
    assert request.model == MODEL and request.lora is None
    await fake_worker.answer(request, ["ok"])
    assert (await (await call).json())["model"] == MODEL


async def test_embeddings_under_an_adapter(
    client: Client, fake_worker: FakeWorker, with_adapter: redis.Redis
) -> None:
    call = asyncio.create_task(
        client.post("/v1/embeddings", json={"input": "hi", "model": ADAPTER})
    )
    request = await fake_worker.take()
    assert request.embed and request.model == MODEL and request.lora == ADAPTER
    vector = pack_vector([3.0, 4.0])
    await fake_worker.reply(
        request, ReplyMessage(request.request_id, 0, finish_reason="stop", embedding=vector)
    )
    response = await call
    assert response.status == 200, await response.text()
    assert (await response.json())["model"] == ADAPTER


async def test_a_batch_line_naming_an_adapter_runs_under_it(
    fake_worker: FakeWorker, with_adapter: redis.Redis, make_client: MakeClient
) -> None:
    client = await make_client(**FAST)
    batch = await create_batch(client, jsonl(line("l", prompt="hi", max_tokens=2, model=ADAPTER)))
    request = await fake_worker.take()
    assert request.model == MODEL and request.lora == ADAPTER
    await fake_worker.reply(request, *replies_for(request, ["o", "k"]))
    done = await wait_status(client, batch["id"], "completed")
    [out] = await file_lines(client, done["output_file_id"])
    assert out["response"]["body"]["model"] == ADAPTER


async def test_tokenize_under_an_adapter_uses_the_base_tokenizer(
    client: Client, with_adapter: redis.Redis
) -> None:
    response = await client.post("/tokenize", json={"model": ADAPTER, "prompt": "hello"})
    assert response.status == 200, await response.text()
    assert (await response.json())["tokens"] == tokens("hello")


async def test_an_unknown_adapter_is_the_404_model_error(
    client: Client, with_adapter: redis.Redis
) -> None:
    response = await client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "tiny-nope"}
    )
    assert response.status == 404
    body = await response.json()
    assert_openai_error(body, param="model")
    assert body["error"]["code"] == "model_not_found"
