"""POST /tokenize, /detokenize and GET /tokenizer_info over HTTP (real Redis, the test playing the
worker): the ids are those a generation request with the same input is enqueued with, the
chat options render as transformers does, lm-eval's remote-tokenizer probes are answered, and
bad input, keys, rate limits and body limits are refused as on the other routes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from engine.models.tiny_model import CHATML_TEMPLATE, build_tiny_tokenizer
from gateway.app_state import GATEWAY
from gateway.config import ApiKey, RateLimits
from gateway.openai.errors import ApiError
from gateway.openai.tokenize_models import TokenizeChat
from gateway.openai.validation import validate
from protocol import ModelCard
from protocol.model_card import card_from_tokenizer
from tests.gateway.helpers import (
    MODEL,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    heartbeat,
    publish_card,
    replies_for,
)

Client = TestClient[Any, Any]
SECRET = "SECRET-7c1d"  # planted in bad input: no error may repeat it
MAX_LEN = 4096  # room for the tool descriptions
# The template reads a kwarg (enable_thinking) and can refuse (refuse), for chat_template_kwargs.
TEMPLATE = (
    CHATML_TEMPLATE + "{% if enable_thinking %}<think>{% endif %}"
    "{% if refuse %}{{ raise_exception('refused by the template') }}{% endif %}"
    "{% if count %}{{ count + 1 }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
TEXT = "What is the capital of France? <|im_end|> é 日本"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer with a BOS post-processor (so add_special_tokens changes the ids)
    and a template that reads kwargs."""
    tok = build_tiny_tokenizer()
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def card(tokenizer: PreTrainedTokenizerFast) -> ModelCard:
    return card_from_tokenizer(MODEL, tokenizer, MAX_LEN, [tokenizer.eos_token_id])


async def post(client: Client, route: str, body: Any) -> tuple[int, Any]:
    response = await client.post(route, json=body)
    return response.status, await response.json()


async def ok(client: Client, route: str, body: Any) -> Any:
    status, out = await post(client, route, body)
    assert status == 200, out
    return out


async def enqueued_ids(client: Client, worker: FakeWorker, route: str, body: Any) -> list[int]:
    """The prompt ids a generation request is enqueued with (its answer is not waited for)."""
    call = asyncio.create_task(client.post(route, json={**body, "max_tokens": 1}))
    request = await worker.take()
    await worker.reply(request, *replies_for(request, ["ok"]))
    assert (await call).status == 200
    return request.prompt_token_ids


# --- the same ids as generation -----------------------------------------------------------------


async def test_a_prompt_gets_the_ids_of_a_completion(
    client: Client, fake_worker: FakeWorker, tokenizer: PreTrainedTokenizerFast
) -> None:
    out = await ok(client, "/tokenize", {"model": MODEL, "prompt": TEXT})
    expected = await enqueued_ids(client, fake_worker, "/v1/completions", {"prompt": TEXT})
    assert out["tokens"] == expected and expected[0] == tokenizer.bos_token_id
    assert out["count"] == len(expected) and out["max_model_len"] == MAX_LEN
    assert out["token_strs"] is None


async def test_without_special_tokens_the_bos_is_left_out(
    client: Client, tokenizer: PreTrainedTokenizerFast
) -> None:
    body = {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True}
    out = await ok(client, "/tokenize", body)
    assert out["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert out["tokens"][0] != tokenizer.bos_token_id
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert "<|im_end|>" in out["token_strs"]  # a special token in the text is its own id


@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "none"}],
    ids=["plain", "tools", "tool_choice_none"],
)
async def test_messages_get_the_ids_of_a_chat_completion(
    client: Client, fake_worker: FakeWorker, extra: dict[str, Any]
) -> None:
    body = {"messages": CHAT, **extra}
    out = await ok(client, "/tokenize", body)
    expected = await enqueued_ids(client, fake_worker, "/v1/chat/completions", body)
    assert out["tokens"] == expected and out["count"] == len(expected)


CONTINUED = [*CHAT, {"role": "assistant", "content": "It is"}]
OPTIONS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"messages": CHAT, "add_generation_prompt": False}, {"add_generation_prompt": False}),
    (
        {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True},
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
    (
        {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}},
        {"add_generation_prompt": True, "enable_thinking": True},
    ),
]


@pytest.mark.parametrize(("body", "options"), OPTIONS, ids=["no_prompt", "continue", "kwargs"])
async def test_chat_options_render_as_transformers_does(
    client: Client, tokenizer: PreTrainedTokenizerFast, body: dict[str, Any], options: Any
) -> None:
    messages = body["messages"]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    out = await ok(client, "/tokenize", body)
    assert out["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    plain = await ok(client, "/tokenize", {"messages": messages})
    assert out["tokens"] != plain["tokens"]  # the option changed the rendering


async def test_chat_with_special_tokens_adds_the_bos(
    client: Client, tokenizer: PreTrainedTokenizerFast
) -> None:
    plain = await ok(client, "/tokenize", {"messages": CHAT})
    out = await ok(client, "/tokenize", {"messages": CHAT, "add_special_tokens": True})
    assert out["tokens"] == [tokenizer.bos_token_id, *plain["tokens"]]


async def test_detokenize_round_trips_specials_included(client: Client) -> None:
    ids = (await ok(client, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}))["tokens"]
    assert await ok(client, "/detokenize", {"model": MODEL, "tokens": ids}) == {"prompt": TEXT}
    assert await ok(client, "/detokenize", {"tokens": []}) == {"prompt": ""}


# --- lm-evaluation-harness' remote tokenizer ----------------------------------------------------


async def test_tokenizer_info_answers_lm_evals_probe(
    client: Client, tokenizer: PreTrainedTokenizerFast
) -> None:
    """lm-eval reads eos_token and bos_token here and their ids from /tokenize (no model,
    add_special_tokens false), and renders chat_template itself."""
    response = await client.get("/tokenizer_info")
    assert response.status == 200
    info = await response.json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert info["eos_token_id"] == tokenizer.eos_token_id and info["unk_token"] is None
    assert info["chat_template"] == TEMPLATE
    assert info["model_max_length"] == info["max_model_len"] == MAX_LEN
    assert info["vocab_size"] == len(tokenizer) and info["model"] == MODEL
    for name in ("eos_token", "bos_token"):
        probe = {"prompt": info[name], "add_special_tokens": False}
        assert (await ok(client, "/tokenize", probe))["tokens"] == [info[f"{name}_id"]]
    named = await client.get("/tokenizer_info", params={"model": MODEL})
    assert await named.json() == info


# --- refusals -----------------------------------------------------------------------------------

BAD: list[tuple[str, Any, int, str | None]] = [
    ("/tokenize", {"model": SECRET, "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": 5, "prompt": "x"}, 400, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": None}, 400, "prompt"),
    ("/tokenize", {"prompt": SECRET + "\ud800"}, 400, "prompt"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": SECRET}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": SECRET, "content": "x"}]}, 400, "messages[0].role"),
    (
        "/tokenize",
        {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
        400,
        "continue_final_message",
    ),
    (
        "/tokenize",
        {"messages": CHAT, "chat_template_kwargs": [SECRET]},
        400,
        "chat_template_kwargs",
    ),
    (
        "/tokenize",
        {"messages": CHAT, "chat_template_kwargs": {"tools": SECRET}},
        400,
        "chat_template_kwargs",
    ),
    (
        "/tokenize",
        {"messages": CHAT, "chat_template_kwargs": {"x": SECRET + "\ud800"}},
        400,
        "chat_template_kwargs",
    ),
    ("/tokenize", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    (
        "/tokenize",
        {"messages": CHAT, "chat_template_kwargs": {"refuse": True, SECRET: 1}},
        400,
        "messages",
    ),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"count": SECRET}}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"count": [SECRET]}}, 400, "messages"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": SECRET}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"model": SECRET, "tokens": [1]}, 404, "model"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD)
async def test_bad_input_is_an_openai_error_that_quotes_nothing(
    client: Client, route: str, body: Any, status: int, param: str | None
) -> None:
    raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as \ud800
    response = await client.post(route, data=raw, headers={"Content-Type": "application/json"})
    text = await response.text()
    assert response.status == status, text
    assert SECRET not in text
    assert_openai_error(json.loads(text), param)


def test_template_kwargs_nested_past_the_encoder_are_refused() -> None:
    """Deeper than json can encode (a body's JSON parse stops shallower; a batch line or
    another caller may not)."""
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(5_000):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(ApiError) as refused:
        validate(TokenizeChat, {"messages": CHAT, "chat_template_kwargs": deep})
    assert (
        refused.value.param == "chat_template_kwargs"
        and "nested too deeply" in refused.value.message
    )


async def test_a_template_refusal_is_a_400_in_its_own_words(client: Client) -> None:
    body = {"messages": CHAT, "chat_template_kwargs": {"refuse": True}}
    status, out = await post(client, "/tokenize", body)
    assert status == 400 and "refused by the template" in out["error"]["message"]


@pytest.mark.parametrize("raw", [b"{", b"[1]", b"\xff"], ids=["truncated", "array", "utf8"])
@pytest.mark.parametrize("route", ["/tokenize", "/detokenize"])
async def test_bodies_that_are_not_json_objects_are_refused(
    client: Client, route: str, raw: bytes
) -> None:
    response = await client.post(route, data=raw, headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "invalid_json"


async def test_tokenizer_info_of_an_unknown_model_is_a_404(client: Client) -> None:
    for name in (SECRET, "x" * 1000):
        response = await client.get("/tokenizer_info", params={"model": name})
        text = await response.text()
        assert response.status in (400, 404) and SECRET not in text
        assert_openai_error(json.loads(text), "model")


async def test_a_model_without_a_chat_template_refuses_messages(
    served: redis.Redis, make_client: MakeClient, tokenizer: PreTrainedTokenizerFast
) -> None:
    plain = card_from_tokenizer("plain", build_tiny_tokenizer(), MAX_LEN, [2])
    plain.chat_template = None
    publish_card(served, plain)
    heartbeat(served, "plain-worker", model="plain")
    client = await make_client()
    for extra in ({}, {"add_generation_prompt": False}):  # chat_ids' check, and the route's
        body = {"model": "plain", "messages": CHAT, **extra}
        status, out = await post(client, "/tokenize", body)
        assert status == 400 and out["error"]["param"] == "messages", out
    status, out = await post(client, "/tokenize", {"prompt": "x"})
    assert status == 400 and out["error"]["param"] == "model"  # two models: name one


# --- keys, rate limits, body limits, draining ---------------------------------------------------

ROUTES = [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info")]
BODIES = {"/tokenize": {"prompt": "x"}, "/detokenize": {"tokens": [1]}, "/tokenizer_info": None}


async def call(client: Client, method: str, route: str, **kwargs: Any) -> int:
    response = await client.request(method, route, json=BODIES[route], **kwargs)
    await response.read()
    return response.status


async def test_api_keys_guard_the_routes(served: redis.Redis, make_client: MakeClient) -> None:
    client = await make_client(api_keys=(ApiKey("a", "KEY-a-123456"),))
    for method, route in ROUTES:
        assert await call(client, method, route) == 401
        assert await call(client, method, route, headers={"Authorization": "Bearer no"}) == 401
        good = {"Authorization": "Bearer KEY-a-123456"}
        assert await call(client, method, route, headers=good) == 200


@pytest.mark.parametrize(("method", "route"), ROUTES)
async def test_each_call_is_one_request_of_the_rate_limit(
    served: redis.Redis, make_client: MakeClient, method: str, route: str
) -> None:
    client = await make_client(rate_limits=RateLimits(rps=0.1, burst=2))
    assert [await call(client, method, route) for _ in range(3)] == [200, 200, 429]


async def test_a_body_over_the_limit_is_a_413(served: redis.Redis, make_client: MakeClient) -> None:
    client = await make_client(max_body_bytes=1024)
    status, out = await post(client, "/tokenize", {"prompt": SECRET * 200})
    assert status == 413 and SECRET not in json.dumps(out)


async def test_a_draining_gateway_sends_callers_elsewhere(client: Client) -> None:
    client.app[GATEWAY].draining = True
    try:
        for method, route in ROUTES:
            assert await call(client, method, route) == 503
    finally:
        client.app[GATEWAY].draining = False
