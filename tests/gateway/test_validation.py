"""Bad input: the right status and OpenAI error body, nothing enqueued, the input never echoed."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient

from gateway.app_state import GATEWAY
from tests.gateway.helpers import MAX_MODEL_LEN, REQUESTS, MakeClient, assert_openai_error

Client = TestClient[Any, Any]
SECRET = "SECRET-7f3a"  # planted in every bad body; it must never come back
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": SECRET}]
IMAGE = {"type": "image_url", "image_url": SECRET}

# (route, body: raw bytes or a JSON-able object, expected param)
BAD_REQUESTS: list[tuple[str, Any, str | None]] = [
    (COMPLETIONS, b'{"prompt": "' + SECRET.encode(), None),  # malformed JSON
    (COMPLETIONS, b"\xff\xfe" + SECRET.encode(), None),  # not UTF-8
    (COMPLETIONS, [SECRET], None),  # not an object
    (COMPLETIONS, b'{"prompt": "' + SECRET.encode() + b'", "temperature": NaN}', None),
    (COMPLETIONS, b"[" * 100_000, None),  # nesting deeper than the parser's recursion limit
    (COMPLETIONS, {"model": "tiny"}, "prompt"),  # missing
    (COMPLETIONS, {"prompt": {SECRET: 1}}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [SECRET, ""]}, "prompt"),  # several prompts, one empty
    (COMPLETIONS, {"prompt": [SECRET, 5]}, "prompt"),  # texts and ids mixed
    (COMPLETIONS, {"prompt": [[1, 2], [SECRET]]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [3, -1]]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [3, 10**9]]}, "prompt"),  # outside the vocabulary
    (COMPLETIONS, {"prompt": [SECRET, "\ud800" + SECRET]}, "prompt"),  # a lone surrogate
    (COMPLETIONS, {"prompt": [1, -2]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 10**9]}, "prompt"),  # outside the vocabulary
    (COMPLETIONS, {"prompt": [1, True]}, "prompt"),
    (COMPLETIONS, {"prompt": SECRET, "max_tokens": SECRET}, "max_tokens"),
    (COMPLETIONS, {"prompt": SECRET, "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": SECRET, "max_tokens": 2.5}, "max_tokens"),
    (COMPLETIONS, {"prompt": SECRET, "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": SECRET, "temperature": SECRET}, "temperature"),
    (COMPLETIONS, {"prompt": SECRET, "temperature": 3}, "temperature"),
    (COMPLETIONS, {"prompt": SECRET, "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": SECRET, "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": SECRET, "top_k": SECRET}, "top_k"),
    (COMPLETIONS, {"prompt": SECRET, "top_k": -5}, "top_k"),
    (COMPLETIONS, {"prompt": SECRET, "seed": 1.5}, "seed"),
    (COMPLETIONS, {"prompt": SECRET, "stop": 5}, "stop"),
    (COMPLETIONS, {"prompt": SECRET, "stop": [SECRET, ""]}, "stop"),
    (COMPLETIONS, {"prompt": SECRET, "stop_token_ids": [SECRET]}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": SECRET, "ignore_eos": SECRET}, "ignore_eos"),
    (COMPLETIONS, {"prompt": SECRET, "n": 17}, "n"),  # over MAX_CHOICES
    (COMPLETIONS, {"prompt": SECRET, "echo": SECRET}, "echo"),
    (COMPLETIONS, {"prompt": SECRET, "stream": SECRET}, "stream"),
    (COMPLETIONS, {"prompt": SECRET, "stream_options": {"include_usage": True}}, "stream_options"),
    (
        COMPLETIONS,
        {"prompt": SECRET, "stream": True, "stream_options": {"include_usage": SECRET}},
        "stream_options.include_usage",
    ),
    (COMPLETIONS, {"prompt": SECRET, "model": 5}, "model"),
    (CHAT, {"model": "tiny"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": SECRET}, "messages"),
    (CHAT, {"messages": [SECRET]}, "messages[0]"),
    (CHAT, {"messages": [{"role": SECRET, "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [*USER, {"role": "user", "content": 5}]}, "messages[1].content"),
    (CHAT, {"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0]"),
    (CHAT, {"messages": USER, "top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": 1}, "logprobs"),
    (COMPLETIONS, {"prompt": SECRET, "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": SECRET, "logprobs": True}, "logprobs"),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "name": SECRET}]},
        "tools[0].function",
    ),
    (CHAT, {"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens"),
    # Added with the reliability audit:
    (COMPLETIONS, ('{"prompt": "' + SECRET + '"}').encode("utf-16"), None),  # UTF-16, not UTF-8
    (COMPLETIONS, b'{"prompt": "' + SECRET.encode() + b'\xed\xa0\x80"}', None),  # CESU surrogate
    (COMPLETIONS, b'{"prompt": "' + SECRET.encode() + b'\\ud800"}', "prompt"),  # escaped one
    (COMPLETIONS, b'{"prompt": "x", "model": "\\udc00' + SECRET.encode() + b'"}', "model"),
    (COMPLETIONS, b'{"prompt": "x", "stop": ["\\ud800' + SECRET.encode() + b'"]}', "stop"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\ud83d' + SECRET.encode() + b'"}]}',
        "messages[0].content",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
        "messages[0].content",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "x", "name": "\\udfff"}]}',
        "messages[0].name",
    ),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),  # > 4300 digits
    (COMPLETIONS, b'{"prompt": "x", "temperature": 1e999}', "temperature"),  # parses as inf
    (COMPLETIONS, {"prompt": SECRET, "temperature": -0.5}, "temperature"),
    (COMPLETIONS, {"prompt": SECRET, "top_p": -0.1}, "top_p"),
    (COMPLETIONS, {"prompt": SECRET, "max_tokens": 10**30}, "max_tokens"),
    (COMPLETIONS, {"prompt": SECRET, "max_tokens": 10**6}, "prompt"),  # over the context window
    (COMPLETIONS, {"prompt": SECRET, "stop": [SECRET] * 17}, "stop"),
    (COMPLETIONS, {"prompt": SECRET, "stop": SECRET * 30}, "stop"),  # over 256 characters
    (COMPLETIONS, {"prompt": SECRET, "stop_token_ids": list(range(257))}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": SECRET, "stop_token_ids": [2**40]}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": [1, 2**40]}, "prompt"),
    (COMPLETIONS, {"prompt": SECRET, "model": SECRET * 30}, "model"),  # over 256 characters
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, b"", None),
    # Penalties, bias and min_tokens (accepted since the sampler applies them):
    (COMPLETIONS, {"prompt": SECRET, "presence_penalty": 2.5}, "presence_penalty"),
    (COMPLETIONS, {"prompt": SECRET, "frequency_penalty": SECRET}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": SECRET, "repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": SECRET, "logit_bias": [1, 2]}, "logit_bias"),
    (COMPLETIONS, {"prompt": SECRET, "logit_bias": {SECRET: 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": SECRET, "logit_bias": {"-3": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": SECRET, "logit_bias": {"5": 101}}, "logit_bias"),
    (COMPLETIONS, {"prompt": SECRET, "logit_bias": {"5": True}}, "logit_bias"),
    (COMPLETIONS, {"prompt": SECRET, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    (COMPLETIONS, {"prompt": SECRET, "logit_bias": {"100000": 1}}, "logit_bias"),  # vocabulary
    (COMPLETIONS, {"prompt": SECRET, "min_tokens": -1}, "min_tokens"),
    (COMPLETIONS, {"prompt": SECRET, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    # Structured outputs, tools, echo, n (each refused before anything is queued):
    (CHAT, {"messages": USER, "response_format": {"type": SECRET}}, "response_format.type"),
    (CHAT, {"messages": USER, "guided_regex": "a(" + SECRET}, "guided_regex"),  # compiled
    (CHAT, {"messages": USER, "guided_grammar": "start: " + SECRET}, "guided_grammar"),
    (COMPLETIONS, {"prompt": SECRET, "guided_json": {"$ref": "#/" + SECRET}}, "guided_json"),
    (COMPLETIONS, {"prompt": SECRET, "guided_json": {"x": "y" * 70_000}}, "guided_json"),
    (CHAT, {"messages": USER, "structured_outputs": {SECRET: 1}}, "structured_outputs"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": SECRET + " "}}]},
        "tools[0].function.name",
    ),
    (
        CHAT,
        {"messages": [{"role": "tool", "content": SECRET, "tool_call_id": 1}]},
        "messages[0].tool_call_id",
    ),
    (COMPLETIONS, {"prompt": SECRET, "n": 2, "best_of": 3}, "best_of"),
    (COMPLETIONS, {"prompt": SECRET, "n": 0}, "n"),
    (COMPLETIONS, {"prompt": SECRET, "suffix": SECRET}, "suffix"),
    # Predicted outputs: OpenAI's shape, text only, within the context window.
    (CHAT, {"messages": USER, "prediction": SECRET}, "prediction"),
    (CHAT, {"messages": USER, "prediction": {"type": SECRET, "content": "x"}}, "prediction"),
    (CHAT, {"messages": USER, "prediction": {"type": "content"}}, "prediction.content"),
    (
        CHAT,
        {"messages": USER, "prediction": {"type": "content", "content": [{"type": SECRET}]}},
        "prediction.content[0]",
    ),
    (
        COMPLETIONS,
        {"prompt": SECRET, "prediction": {"type": "content", "content": SECRET * 5000}},
        "prediction",
    ),
    (COMPLETIONS, {"prompt": SECRET, "max_tokens": 0, "echo": False}, "max_tokens"),
]


async def post(client: Client, route: str, body: Any) -> tuple[int, dict[str, Any], str]:
    if isinstance(body, bytes):
        response = await client.post(route, data=body)
    else:
        response = await client.post(route, json=body)
    text = await response.text()
    return response.status, json.loads(text), text


async def test_bad_requests_get_400_and_nothing_is_enqueued(
    client: Client, served: redis.Redis
) -> None:
    """Every class of bad input: 400, OpenAI body naming the field, no XADD, no echo."""
    for route, body, param in BAD_REQUESTS:
        case = f"{route} {str(body)[:80]}"
        status, out, text = await post(client, route, body)
        assert status == 400, case
        assert_openai_error(out, param)
        assert out["error"]["type"] == "invalid_request_error", case
        assert SECRET not in text, case
    assert served.xlen(REQUESTS) == 0


async def test_prompt_too_long_gives_the_numbers(client: Client, served: redis.Redis) -> None:
    """prompt + max_tokens over max_model_len: 400 with prompt tokens, max_tokens and the limit."""
    prompt = list(range(3, 3 + 60))
    status, out, _ = await post(client, COMPLETIONS, {"prompt": prompt, "max_tokens": 10})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    message = out["error"]["message"]
    assert str(MAX_MODEL_LEN) in message and "60 in the prompt" in message and "10 for" in message
    # A chat whose prompt leaves no room even for the default max_tokens is refused the same way.
    long_chat = [{"role": "user", "content": "x" * 200}]
    status, out, text = await post(client, CHAT, {"messages": long_chat})
    assert status == 400 and out["error"]["param"] == "messages" and "x" * 20 not in text
    assert served.xlen(REQUESTS) == 0


async def test_unknown_model_is_404(client: Client, served: redis.Redis) -> None:
    """A model no live worker serves: 404 model_not_found."""
    status, out, text = await post(client, COMPLETIONS, {"model": SECRET, "prompt": "hi"})
    assert status == 404 and out["error"]["code"] == "model_not_found" and SECRET not in text
    assert_openai_error(out, "model")
    assert served.xlen(REQUESTS) == 0


async def test_body_over_limit_is_413(served: redis.Redis, make_client: MakeClient) -> None:
    """A body over --max-body-bytes: 413 with an OpenAI body, nothing enqueued."""
    client = await make_client(max_body_bytes=1000)
    status, out, text = await post(client, COMPLETIONS, {"prompt": SECRET * 200})
    assert status == 413 and out["error"]["code"] == "request_too_large" and SECRET not in text
    assert served.xlen(REQUESTS) == 0


async def test_unknown_routes_and_methods_get_json_errors(client: Client) -> None:
    """404 and 405 from the router are OpenAI error bodies too."""
    response = await client.get("/v1/" + SECRET)
    assert response.status == 404 and SECRET not in await response.text()
    assert_openai_error(await response.json())
    response = await client.get(COMPLETIONS)
    assert response.status == 405
    assert_openai_error(await response.json())


async def test_unexpected_exception_is_a_bare_500(
    client: Client, served: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug becomes a 500 JSON body without details; the gateway keeps serving."""

    async def broken(name: str | None) -> None:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(client.server.app[GATEWAY].registry, "resolve", broken)
    status, out, text = await post(client, COMPLETIONS, {"prompt": "hi"})
    assert status == 500 and out["error"]["type"] == "server_error" and SECRET not in text
    assert (await client.get("/health")).status == 200
