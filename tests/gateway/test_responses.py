"""The Responses API over HTTP, the test playing the worker: the chat request a response runs
as (prompt, limits, grammar), the response object, its event stream, tool calls, and the 400s
for what this server does not support."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis
from transformers import PreTrainedTokenizerFast

from protocol import ModelCard
from tests.gateway.helpers import (
    MODEL,
    TOKENIZER,
    FakeWorker,
    assert_openai_error,
    enqueued_total,
)
from tests.gateway.responses_helpers import CALL, WEATHER, Client, create, roomy_card


@pytest.fixture(scope="module")
def card(tokenizer: PreTrainedTokenizerFast) -> ModelCard:
    return roomy_card(tokenizer)


async def test_a_plain_create_runs_as_a_chat_and_answers_a_response(
    client: Client, fake_worker: FakeWorker
) -> None:
    request, out = await create(
        client,
        fake_worker,
        ["Hello", " there"],
        input="Hi!",
        instructions="Be brief.",
        max_output_tokens=20,
        temperature=0.5,
        metadata={"k": "v"},
        user="u-1",
    )
    prompt = TOKENIZER.decode(request.prompt_token_ids)
    assert prompt.index("system\nBe brief.") < prompt.index("user\nHi!")
    assert prompt.endswith("assistant\n")
    assert request.sampling_params.max_tokens == 20 and request.sampling_params.temperature == 0.5
    assert out["id"] == request.request_id and out["id"].startswith("resp_")
    assert out["object"] == "response" and out["status"] == "completed"
    assert out["model"] == MODEL and out["error"] is None and out["incomplete_details"] is None
    [message] = out["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "completed" and message["id"].startswith("msg_")
    assert message["content"] == [
        {"type": "output_text", "text": "Hello there", "annotations": [], "logprobs": []}
    ]
    usage = out["usage"]
    assert usage["input_tokens"] == len(request.prompt_token_ids)
    assert usage["output_tokens"] == len(TOKENIZER.encode("Hello")) + len(
        TOKENIZER.encode(" there")
    )
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    echoed = {k: out[k] for k in ("instructions", "max_output_tokens", "metadata", "user")}
    assert echoed == {
        "instructions": "Be brief.",
        "max_output_tokens": 20,
        "metadata": {"k": "v"},
        "user": "u-1",
    }
    assert out["temperature"] == 0.5 and out["store"] is True and out["tools"] == []


async def test_input_items_become_the_chat_in_order(
    client: Client, fake_worker: FakeWorker
) -> None:
    """Messages of every role, parts joined; an earlier call joins the assistant message before
    it, its output is a tool result (the tiny template knows no tools: written as text)."""
    items = [
        {"role": "developer", "content": "Dev."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
    ]
    request, _ = await create(client, fake_worker, ["ok"], input=items, tools=[WEATHER])
    prompt = TOKENIZER.decode(request.prompt_token_ids)
    order = ["Dev.", "user\nab", "Let me see.\n<tool_call>", '"city": "Oslo"', "rain"]
    assert [prompt.index(part) for part in order] == sorted(prompt.index(p) for p in order)
    assert "<tool_response>\nrain\n</tool_response>" in prompt


async def test_max_output_tokens_cut_is_incomplete(client: Client, fake_worker: FakeWorker) -> None:
    _, out = await create(
        client, fake_worker, ["abc"], finish="length", input="x", max_output_tokens=3
    )
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["status"] == "incomplete"


async def test_the_stream_is_the_typed_event_sequence(
    client: Client, fake_worker: FakeWorker
) -> None:
    _, events = await create(client, fake_worker, ["Hel", "lo"], input="x", stream=True)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert final["id"] == created["id"] and final["status"] == "completed"
    assert "".join(e["delta"] for e in events if e["type"].endswith(".delta")) == "Hello"
    assert events[6]["text"] == "Hello" and events[8]["item"] == final["output"][0]
    assert final["usage"]["output_tokens"] > 0


async def test_a_forced_call_is_a_function_call_item(
    client: Client, fake_worker: FakeWorker
) -> None:
    choice = {"type": "function", "name": "get_weather"}
    request, out = await create(
        client, fake_worker, [CALL], input="Weather?", tools=[WEATHER], tool_choice=choice
    )
    assert request.sampling_params.grammar is not None  # one call, forced
    assert '"name": "get_weather"' in TOKENIZER.decode(request.prompt_token_ids)
    [call] = out["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert out["tool_choice"] == choice and out["tools"][0]["name"] == "get_weather"


async def test_streamed_text_then_call_events(client: Client, fake_worker: FakeWorker) -> None:
    _, events = await create(
        client,
        fake_worker,
        ["Checking.", "\n" + CALL[:30], CALL[30:]],
        input="Weather?",
        tools=[WEATHER],
        stream=True,
    )
    kinds = [e["type"] for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "Checking."
    assert events[9]["output_index"] == 1 and events[9]["delta"] == output[1]["arguments"]
    assert events[8]["item"]["arguments"] == "" and events[-2]["item"] == output[1]


async def test_json_schema_format_is_the_grammar(client: Client, fake_worker: FakeWorker) -> None:
    fmt = {"type": "json_schema", "name": "r", "schema": {"type": "object"}, "strict": True}
    request, out = await create(client, fake_worker, ['{"a":1}'], input="x", text={"format": fmt})
    assert request.sampling_params.grammar is not None
    assert out["text"] == {"format": fmt}
    assert out["output"][0]["content"][0]["text"] == '{"a":1}'


async def test_a_worker_failure_is_an_error_then_response_failed(
    client: Client, fake_worker: FakeWorker
) -> None:
    for stream in (False, True):
        call = asyncio.create_task(
            client.post("/v1/responses", json={"input": "x", "stream": stream})
        )
        await fake_worker.reject(await fake_worker.take(), "error", "the step failed")
        response = await call
        if not stream:
            assert response.status == 500
            assert_openai_error(await response.json())
            continue
        events = [
            json.loads(line[6:])
            for line in (await response.text()).splitlines()
            if line.startswith("data: ")
        ]
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["message"] == "the step failed"
        assert events[-1]["response"]["status"] == "failed"
        assert events[-1]["response"]["error"]["code"] == "server_error"


UNSUPPORTED: list[tuple[dict[str, Any], str]] = [
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "encrypted_content": "x"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "content": "x"}]}, "input[0].content"),
    (
        {"input": [{"role": "user", "content": [{"type": "reasoning_text", "text": "x"}]}]},
        "input[0].content",
    ),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0].name"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}}, "text.format"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "input"),  # past the context window
    ({"n": 2}, "n"),
]


@pytest.mark.parametrize(("fields", "param"), UNSUPPORTED)
async def test_what_is_not_supported_is_a_400_naming_the_field(
    client: Client, served: redis.Redis, fields: dict[str, Any], param: str
) -> None:
    response = await client.post("/v1/responses", json={"input": "hi", **fields})
    assert response.status == 400, await response.text()
    out = await response.json()
    assert_openai_error(out, param)
    assert f"'{param}'" in out["error"]["message"] or param == "input"
    assert enqueued_total(served) == 0
