"""Stored responses, the test playing the worker: retrieve and delete, previous_response_id
continuing a conversation, the TTL and the size bound, and one API key never seeing another's
responses (a 404 like an unknown id)."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient
from transformers import PreTrainedTokenizerFast

from gateway.config import ApiKey
from protocol import ModelCard
from tests.gateway.helpers import (
    KEYS,
    TOKENIZER,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    enqueued_total,
    eventually,
)
from tests.gateway.responses_helpers import CALL, WEATHER, Client, create, roomy_card

UNKNOWN = "resp_" + "0" * 32


@pytest.fixture(scope="module")
def card(tokenizer: PreTrainedTokenizerFast) -> ModelCard:
    return roomy_card(tokenizer)


async def status_of(client: Client, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    response = await client.request(method, path, **kw)
    return response.status, await response.json()


async def test_retrieve_gives_the_response_and_delete_removes_it(
    client: Client, fake_worker: FakeWorker
) -> None:
    _, out = await create(client, fake_worker, ["Hi"], input="x")
    assert await status_of(client, "GET", f"/v1/responses/{out['id']}") == (200, out)
    deleted = {"id": out["id"], "object": "response.deleted", "deleted": True}
    assert await status_of(client, "DELETE", f"/v1/responses/{out['id']}") == (200, deleted)
    for method in ("GET", "DELETE"):
        status, body = await status_of(client, method, f"/v1/responses/{out['id']}")
        assert status == 404
        assert_openai_error(body, "response_id")


async def test_store_false_keeps_nothing(client: Client, fake_worker: FakeWorker) -> None:
    _, out = await create(client, fake_worker, ["Hi"], input="x", store=False)
    assert out["store"] is False
    assert (await status_of(client, "GET", f"/v1/responses/{out['id']}"))[0] == 404
    response = await client.post(
        "/v1/responses", json={"input": "y", "previous_response_id": out["id"]}
    )
    assert response.status == 404
    assert_openai_error(await response.json(), "previous_response_id")


async def test_previous_response_id_continues_the_conversation(
    client: Client, fake_worker: FakeWorker
) -> None:
    """Each response's input and output are the next one's history (a forced call, its output
    sent back, then a plain turn); instructions are not carried over."""
    choice = {"type": "function", "name": "get_weather"}
    _, first = await create(
        client,
        fake_worker,
        [CALL],
        input="Weather in Paris?",
        instructions="Use tools.",
        tools=[WEATHER],
        tool_choice=choice,
    )
    call_id = first["output"][0]["call_id"]
    output = {"type": "function_call_output", "call_id": call_id, "output": "sunny"}
    request, second = await create(
        client,
        fake_worker,
        ["It is sunny."],
        input=[output],
        previous_response_id=first["id"],
        tools=[WEATHER],
    )
    prompt = TOKENIZER.decode(request.prompt_token_ids)
    assert "Use tools." not in prompt
    parts = ["Weather in Paris?", '"city": "Paris"', "<tool_response>\nsunny"]
    assert [prompt.index(p) for p in parts] == sorted(prompt.index(p) for p in parts)
    assert second["previous_response_id"] == first["id"]
    request, _ = await create(
        client, fake_worker, ["Bye."], input="Thanks!", previous_response_id=second["id"]
    )
    prompt = TOKENIZER.decode(request.prompt_token_ids)
    parts = ["Weather in Paris?", "sunny", "It is sunny.", "Thanks!"]
    assert [prompt.index(p) for p in parts] == sorted(prompt.index(p) for p in parts)


async def test_a_stored_response_expires_after_its_ttl(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    client = await make_client(responses_ttl_s=1.5)
    _, out = await create(client, fake_worker, ["Hi"], input="x")
    assert 0 < served.pttl(KEYS.response(out["id"])) <= 1500
    assert (await status_of(client, "GET", f"/v1/responses/{out['id']}"))[0] == 200
    path = f"/v1/responses/{out['id']}"
    assert await eventually(lambda: _gone(client, path), timeout=5)


async def _gone(client: Client, path: str) -> bool:
    return (await status_of(client, "GET", path))[0] == 404


async def test_the_size_bound(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """A conversation over the bound is refused before it runs when it is to be stored; an
    output that takes the record over it comes back with store: false."""
    client = await make_client(responses_max_bytes=1500)
    response = await client.post("/v1/responses", json={"input": "a" * 1500})
    assert response.status == 400
    assert_openai_error(await response.json(), "input")
    assert enqueued_total(served) == 0
    _, out = await create(client, fake_worker, ["b" * 1500], input="x")
    assert out["store"] is False
    assert (await status_of(client, "GET", f"/v1/responses/{out['id']}"))[0] == 404
    _, out = await create(client, fake_worker, ["c"], input="a" * 1500, store=False)
    assert out["output"][0]["content"][0]["text"] == "c"


async def test_one_key_never_sees_another_keys_responses(
    served: redis.Redis, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    keys = (ApiKey("alice", "key-alice"), ApiKey("bob", "key-bob"))
    client: TestClient[Any, Any] = await make_client(api_keys=keys)
    alice = {"Authorization": "Bearer key-alice"}
    bob = {"Authorization": "Bearer key-bob"}
    _, out = await create(client, fake_worker, ["Hi"], headers=alice, input="secret")
    path = f"/v1/responses/{out['id']}"
    unknown = await status_of(client, "GET", f"/v1/responses/{UNKNOWN}", headers=bob)
    assert unknown[0] == 404
    assert await status_of(client, "GET", path, headers=bob) == unknown
    assert (await status_of(client, "DELETE", path, headers=bob))[0] == 404
    before = enqueued_total(served)
    body = {"input": "and?", "previous_response_id": out["id"]}
    status, error = await status_of(client, "POST", "/v1/responses", json=body, headers=bob)
    assert status == 404 and error["error"]["code"] == "previous_response_not_found"
    assert enqueued_total(served) == before
    assert await status_of(client, "GET", path, headers=alice) == (200, out)


async def test_retrieve_refuses_what_needs_a_background_response(client: Client) -> None:
    for query, param in (("stream=true", "stream"), ("include[]=x", "include[]")):
        status, body = await status_of(client, "GET", f"/v1/responses/{UNKNOWN}?{query}")
        assert status == 400
        assert_openai_error(body, param)
