"""Helpers of the Responses API's gateway tests: a create played through the fake worker, and
the typed event stream read back."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp.test_utils import TestClient
from transformers import PreTrainedTokenizerFast

from protocol import ModelCard, RequestMessage
from protocol.model_card import card_from_tokenizer
from tests.gateway.helpers import MODEL, FakeWorker, replies_for

Client = TestClient[Any, Any]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


def roomy_card(tokenizer: PreTrainedTokenizerFast) -> ModelCard:
    """Room for tool descriptions and conversations (the tiny tokenizer spends a token on most
    characters)."""
    return card_from_tokenizer(MODEL, tokenizer, 4096, [tokenizer.eos_token_id])


def events(raw: str) -> list[dict[str, Any]]:
    """An event stream's events, each checked to be named by its type."""
    out = []
    for block in raw.strip().split("\n\n"):
        if block.startswith(":"):  # a keep-alive comment
            continue
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", block
        out.append(event)
    return out


async def create(
    client: Client,
    worker: FakeWorker,
    pieces: list[str],
    finish: str = "stop",
    headers: dict[str, str] | None = None,
    **body: Any,
) -> tuple[RequestMessage, Any]:
    """POST /v1/responses, the worker answering `pieces`; the request it got and the response
    (the body, or the events of a stream)."""
    call = asyncio.create_task(client.post("/v1/responses", json=body, headers=headers))
    take = asyncio.create_task(worker.take())
    await asyncio.wait({call, take}, return_when=asyncio.FIRST_COMPLETED)
    if call.done() and call.result().status != 200:  # refused before it was enqueued
        take.cancel()
        raise AssertionError(await call.result().text())
    request = await take
    await worker.reply(request, *replies_for(request, pieces, finish))
    response = await call
    assert response.status == 200, await response.text()
    assert response.headers["X-Request-Id"] == request.request_id
    if body.get("stream"):
        return request, events(await response.text())
    return request, await response.json()
