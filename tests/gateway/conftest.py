"""Gateway fixtures: a real redis-server, a card for the tiny tokenizer, the app in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer
from transformers import PreTrainedTokenizerFast

from engine.models.tiny_model import build_tiny_tokenizer
from gateway.config import GatewayConfig
from gateway.http.app import make_app
from protocol import ModelCard
from protocol.model_card import card_from_tokenizer
from tests.gateway.helpers import (
    MAX_MODEL_LEN,
    MODEL,
    FakeWorker,
    MakeClient,
    heartbeat,
    publish_card,
)
from tests.services import RedisServer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def card(tokenizer: PreTrainedTokenizerFast) -> ModelCard:
    return card_from_tokenizer(MODEL, tokenizer, MAX_MODEL_LEN, [tokenizer.eos_token_id])


@pytest.fixture
def sync_redis(redis_server: RedisServer) -> redis.Redis:
    return redis_server.client()


@pytest.fixture
def served(sync_redis: redis.Redis, card: ModelCard) -> redis.Redis:
    """A model card and a fresh worker heartbeat: the gateway serves `tiny`."""
    publish_card(sync_redis, card)
    heartbeat(sync_redis)
    return sync_redis


@pytest.fixture
async def make_client(redis_server: RedisServer) -> AsyncIterator[MakeClient]:
    """Start the gateway app in-process (handler cancellation on, as `jitney gateway` runs it)."""
    clients: list[TestClient[Any, Any]] = []

    async def factory(**overrides: Any) -> TestClient[Any, Any]:
        config = GatewayConfig(redis_url=redis_server.url, gateway_id="gw-test", port=8000)
        config = replace(config, **overrides)
        client: TestClient[Any, Any] = TestClient(
            TestServer(make_app(config), handler_cancellation=True)
        )
        await client.start_server()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()


@pytest.fixture
async def client(served: redis.Redis, make_client: MakeClient) -> TestClient[Any, Any]:
    return await make_client()


@pytest.fixture
def fake_worker(redis_server: RedisServer) -> Iterator[FakeWorker]:
    worker = FakeWorker.connect(redis_server.url)
    yield worker
    worker.close()
