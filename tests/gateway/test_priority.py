"""`priority` (vLLM's: lower is served first) reaches the worker on the request message: the
body's own, else the API key's default (`priority=N` in the keys file), else 0; and the key's
id (for the live view), never the key."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from gateway.config import parse_api_keys
from protocol import BATCH_PRIORITY, RequestMessage
from tests.gateway.helpers import FakeWorker, MakeClient, assert_openai_error, replies_for

Client = TestClient[Any, Any]
BODY = {"prompt": "hi", "max_tokens": 2}


async def enqueued(
    client: Client, fake_worker: FakeWorker, body: dict, headers: dict | None = None
) -> RequestMessage:
    call = asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))
    request = await fake_worker.take()
    await fake_worker.reply(request, *replies_for(request, ["ok"]))
    assert (await call).status == 200
    return request


async def enqueued_priority(
    client: Client, fake_worker: FakeWorker, body: dict, headers: dict | None = None
) -> int:
    return (await enqueued(client, fake_worker, body, headers)).priority


async def test_the_body_s_priority_or_0(client: Client, fake_worker: FakeWorker) -> None:
    assert await enqueued_priority(client, fake_worker, {**BODY, "priority": -3}) == -3
    request = await enqueued(client, fake_worker, BODY)
    assert request.priority == 0 and request.key_id is None  # no keys configured


@pytest.mark.parametrize("value", [-101, BATCH_PRIORITY, 1.5, "high", True])
async def test_a_priority_out_of_range_is_a_400(client: Client, value: Any) -> None:
    resp = await client.post("/v1/completions", json={**BODY, "priority": value})
    assert resp.status == 400
    assert_openai_error(await resp.json(), param="priority")


async def test_an_api_key_s_default_priority(
    served: Any, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    keys = parse_api_keys(["batchy:k1 priority=7", "vip:k2"], "test")
    client = await make_client(api_keys=tuple(keys))
    batchy = {"Authorization": "Bearer k1"}
    assert await enqueued_priority(client, fake_worker, BODY, batchy) == 7
    assert await enqueued_priority(client, fake_worker, {**BODY, "priority": 1}, batchy) == 1
    vip = {"Authorization": "Bearer k2"}
    request = await enqueued(client, fake_worker, BODY, vip)
    assert request.priority == 0 and request.key_id == "vip"  # the id, never the key


def test_a_key_s_priority_is_checked_when_the_keys_are_read() -> None:
    with pytest.raises(ValueError, match=r"priority must be in \[-100, 100\]"):
        parse_api_keys(["k priority=500"], "test")
    with pytest.raises(ValueError, match="options are rps=N, burst=N, tpm=N, priority=N"):
        parse_api_keys(["k urgency=1"], "test")


async def test_metrics_count_waiting_requests_by_priority_and_tokens_by_key(
    served: Any, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """What the dashboard's work-class panels read: requests not yet started, by priority
    (back to 0 once a worker starts them), and each key's tokens once its request ends."""
    keys = parse_api_keys(["batchy:k1 priority=7", "vip:k2"], "test")
    client = await make_client(api_keys=tuple(keys))
    usage = {}
    for key_id, extra, texts in (("batchy", {}, ["ok", "!"]), ("vip", {"priority": -2}, ["ok"])):
        headers = {"Authorization": f"Bearer k{1 if key_id == 'batchy' else 2}"}
        body = {**BODY, **extra}
        call = asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))
        request = await fake_worker.take()  # read, not answered: no worker has started it
        text = await (await client.get("/metrics", headers=headers)).text()
        assert f'jitney_gateway_waiting_requests{{priority="{request.priority}"}} 1.0' in text
        await fake_worker.reply(request, *replies_for(request, texts))
        response = await call
        assert response.status == 200
        usage[key_id] = (await response.json())["usage"]
    text = await (await client.get("/metrics", headers=headers)).text()
    assert 'jitney_gateway_waiting_requests{priority="7"} 0.0' in text
    assert 'jitney_gateway_waiting_requests{priority="-2"} 0.0' in text
    for key_id, used in usage.items():
        for kind in ("prompt", "completion"):
            labels = f'key_id="{key_id}",kind="{kind}",model="{request.model}"'
            assert f"jitney_key_tokens_total{{{labels}}} {used[kind + '_tokens']}.0" in text
