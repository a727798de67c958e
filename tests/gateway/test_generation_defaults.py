"""The model's own sampling defaults, as its card carries them: the gateway fills them into the
fields a request did not send (a sent value always wins, even the API's default), for chat,
completions and Batch API lines alike, and /v1/models lists them. The test plays the worker and
reads the sampling parameters the gateway enqueued."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient

from gateway.openai.request_models import parse_chat, parse_completion
from generation import SamplingParams
from protocol import ModelCard
from protocol.sampling_defaults import SamplingDefaults
from tests.gateway.helpers import (
    MAX_MODEL_LEN,
    FakeWorker,
    MakeClient,
    heartbeat,
    publish_card,
    replies_for,
)
from tests.gateway.test_batches import FAST, create_batch, file_lines, jsonl, line, wait_status

Client = TestClient[Any, Any]
CHAT = [{"role": "user", "content": "hi"}]
DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}


@pytest.fixture
async def defaults_client(
    sync_redis: redis.Redis, card: ModelCard, make_client: MakeClient
) -> Client:
    """The gateway serving `tiny` with DEFAULTS in its card."""
    publish_card(sync_redis, replace(card, sampling_defaults=DEFAULTS))
    heartbeat(sync_redis)
    return await make_client(**FAST)


async def sent(client: Client, worker: FakeWorker, route: str, body: dict[str, Any]) -> Any:
    """The sampling parameters the gateway enqueued for `body` (answered, so the call ends)."""
    call = asyncio.create_task(client.post(route, json=body))
    request = await worker.take()
    await worker.reply(request, *replies_for(request, ["ok"]))
    response = await call
    assert response.status == 200, await response.text()
    return request.sampling_params


def picked(params: SamplingParams) -> dict[str, Any]:
    return {k: getattr(params, k) for k in DEFAULTS}


@pytest.mark.parametrize(
    ("route", "body"),
    [("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "hi"})],
)
async def test_a_request_that_sends_no_sampling_fields_gets_the_model_s_defaults(
    defaults_client: Client, fake_worker: FakeWorker, route: str, body: dict[str, Any]
) -> None:
    """Chat and completions alike take every default the card carries."""
    assert picked(await sent(defaults_client, fake_worker, route, body)) == DEFAULTS


async def test_a_sent_value_wins_even_the_api_default_and_null_is_not_given(
    defaults_client: Client, fake_worker: FakeWorker
) -> None:
    """temperature 1.0 and top_k 0 sent are kept (the API's defaults, told apart from absent);
    a null top_p is "not given", so it takes the model's default."""
    body = {"messages": CHAT, "temperature": 1.0, "top_k": 0, "top_p": None}
    params = await sent(defaults_client, fake_worker, "/v1/chat/completions", body)
    assert picked(params) == {**DEFAULTS, "temperature": 1.0, "top_k": 0}


async def test_an_lm_eval_scoring_request_keeps_its_greedy_echo(
    defaults_client: Client, fake_worker: FakeWorker
) -> None:
    """lm-eval's local-completions loglikelihood payload stays greedy with its one token: the
    defaults fill only what it leaves out (top_p, top_k, repetition_penalty), which a greedy
    pick ignores; prompt log-probs are the raw model's whatever the sampling fields."""
    body = {
        "prompt": "the cat",
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    params = await sent(defaults_client, fake_worker, "/v1/completions", body)
    assert (params.temperature, params.max_tokens, params.prompt_logprobs) == (0.0, 1, 1)
    assert params.is_greedy


async def test_a_batch_line_gets_the_defaults(
    defaults_client: Client, fake_worker: FakeWorker
) -> None:
    """A Batch API line takes the same path: the defaults in what it leaves out."""
    batch = await create_batch(
        defaults_client, jsonl(line("a", prompt="hi", max_tokens=2, temperature=0.7))
    )
    request = await fake_worker.take()
    assert picked(request.sampling_params) == {**DEFAULTS, "temperature": 0.7}
    await fake_worker.reply(request, *replies_for(request, ["ok"]))
    done = await wait_status(defaults_client, batch["id"], "completed")
    [out] = await file_lines(defaults_client, done["output_file_id"])
    assert out["response"]["status_code"] == 200


async def test_a_default_max_tokens_is_capped_to_the_room_left_and_a_sent_one_wins(
    sync_redis: redis.Redis, card: ModelCard, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    """max_new_tokens' default replaces the route's (16 for completions) but never makes a
    request too long: it is capped to the context left; a sent max_tokens is the client's."""
    publish_card(sync_redis, replace(card, sampling_defaults={"max_tokens": 40}))
    heartbeat(sync_redis)
    client = await make_client()
    short = await sent(client, fake_worker, "/v1/completions", {"prompt": "hi"})
    assert short.max_tokens == 40
    long_prompt = "x" * (MAX_MODEL_LEN - 10)  # byte-level: one token per character
    capped = await sent(client, fake_worker, "/v1/completions", {"prompt": long_prompt})
    assert capped.max_tokens == 10
    chat = await sent(client, fake_worker, "/v1/chat/completions", {"messages": CHAT})
    assert chat.max_tokens == 40  # not chat's own default (all that fits, here 64 - prompt)
    mine = await sent(client, fake_worker, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert mine.max_tokens == 3


async def test_without_defaults_in_the_card_the_api_s_own_apply(
    client: Client, fake_worker: FakeWorker
) -> None:
    """A model whose card has none (tiny-random, or --generation-config vllm) keeps the API's
    defaults, and /v1/models says so with an empty object."""
    params = await sent(client, fake_worker, "/v1/completions", {"prompt": "hi"})
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, 16)
    [model] = (await (await client.get("/v1/models")).json())["data"]
    assert model["sampling_defaults"] == {}


async def test_v1_models_lists_the_defaults_in_force(defaults_client: Client) -> None:
    [model] = (await (await defaults_client.get("/v1/models")).json())["data"]
    assert model["sampling_defaults"] == DEFAULTS


@pytest.mark.parametrize(
    "bad", [{"temperature": 3.0}, {"min_p": 0.1}, {"top_k": "40"}], ids=json.dumps
)
async def test_a_card_with_bad_defaults_is_not_served(
    sync_redis: redis.Redis, card: ModelCard, make_client: MakeClient, bad: dict[str, Any]
) -> None:
    """A card whose defaults do not validate is passed over like any malformed card: the
    model is not listed and its requests are a 404, never run with half-read defaults."""
    publish_card(sync_redis, replace(card, sampling_defaults=bad))
    heartbeat(sync_redis)
    client = await make_client()
    assert (await (await client.get("/v1/models")).json())["data"] == []
    response = await client.post("/v1/completions", json={"model": card.name, "prompt": "hi"})
    assert response.status == 404


async def test_the_defaults_keep_the_request_s_output_format(
    defaults_client: Client, fake_worker: FakeWorker
) -> None:
    """A request with a grammar (response_format) keeps it beside the filled-in defaults."""
    body = {"messages": CHAT, "response_format": {"type": "json_object"}}
    params = await sent(defaults_client, fake_worker, "/v1/chat/completions", body)
    assert params.grammar is not None and picked(params) == DEFAULTS


def test_with_defaults_tells_sent_from_absent_on_the_parsed_request() -> None:
    """The request models themselves: a sent value (even the API's default) is kept, null and
    absent take the default, chat's max_completion_tokens counts as a sent max_tokens, and the
    copy's sampling parameters are rebuilt (not the original's cached ones)."""
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9, max_tokens=30)
    chat = parse_chat({"messages": CHAT, "temperature": 1, "top_p": None})
    assert chat.sampling.temperature == 1.0  # read (and cached) before the defaults
    filled = chat.with_defaults(defaults, room=100)
    assert (filled.sampling.temperature, filled.sampling.top_p, filled.max_tokens) == (1.0, 0.9, 30)
    assert chat.sampling.top_p == 1.0  # the original is unchanged
    capped = parse_chat({"messages": CHAT, "max_completion_tokens": 7})
    assert capped.with_defaults(defaults, room=100).max_tokens == 7
    assert parse_completion({"prompt": "hi"}).with_defaults(defaults, room=4).max_tokens == 4
    plain = parse_completion({"prompt": "hi"})
    assert plain.with_defaults(SamplingDefaults(), room=100) is plain  # nothing to fill
