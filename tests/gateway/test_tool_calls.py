"""Function calling over HTTP, the test playing the worker: the prompt and grammar the worker
gets, and tool calls in OpenAI's non-stream and stream shapes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from transformers import PreTrainedTokenizerFast

from protocol import ModelCard, RequestMessage
from protocol.model_card import card_from_tokenizer
from tests.gateway.helpers import MODEL, TOKENIZER, FakeWorker, replies_for, sse_events

Client = TestClient[Any, Any]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def card(tokenizer: PreTrainedTokenizerFast) -> ModelCard:
    """Room for the tool descriptions (the tiny tokenizer spends a token on most characters)."""
    return card_from_tokenizer(MODEL, tokenizer, 4096, [tokenizer.eos_token_id])


CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


async def ask(
    client: Client, fake_worker: FakeWorker, pieces: list[str], **fields: Any
) -> tuple[RequestMessage, Any]:
    body = {"messages": USER, "tools": [WEATHER], **fields}
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    request = await fake_worker.take()
    await fake_worker.reply(request, *replies_for(request, pieces))
    response = await call
    assert response.status == 200, await response.text()
    if fields.get("stream"):
        return request, sse_events(await response.text())
    return request, await response.json()


async def test_auto_puts_the_tools_in_the_prompt_and_reads_the_calls(
    client: Client, fake_worker: FakeWorker
) -> None:
    request, out = await ask(client, fake_worker, ["I will check.\n", CALL[:20], CALL[20:]])
    prompt = TOKENIZER.decode(request.prompt_token_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert request.sampling_params.grammar is None  # auto: the model decides
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "I will check."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


async def test_auto_without_a_call_is_plain_content(
    client: Client, fake_worker: FakeWorker
) -> None:
    _, out = await ask(client, fake_worker, ["It is ", "<b>sunny</b>"])
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is <b>sunny</b>"}
    assert choice["finish_reason"] == "stop"


async def test_required_sends_a_grammar_and_the_content_is_null(
    client: Client, fake_worker: FakeWorker
) -> None:
    request, out = await ask(client, fake_worker, [CALL], tool_choice="required")
    assert request.sampling_params.grammar is not None
    message = out["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1


async def test_none_leaves_tools_out_and_text_alone(
    client: Client, fake_worker: FakeWorker
) -> None:
    request, out = await ask(client, fake_worker, [CALL], tool_choice="none")
    assert "<tools>" not in TOKENIZER.decode(request.prompt_token_ids)
    assert out["choices"][0]["message"]["content"] == CALL


async def test_a_conversation_with_calls_and_results_is_accepted(
    client: Client, fake_worker: FakeWorker
) -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
    ]
    request, out = await ask(client, fake_worker, ["Sunny."], messages=messages)
    prompt = TOKENIZER.decode(request.prompt_token_ids)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert out["choices"][0]["message"]["content"] == "Sunny."


async def test_streamed_calls_in_openais_delta_shape(
    client: Client, fake_worker: FakeWorker
) -> None:
    """Text that may open a call is held back; each call: a delta with id, type and name, then
    one with the arguments; finish_reason tool_calls."""
    second = CALL.replace("Paris", "Oslo")
    pieces = ["Checking", " <tool", "_call>", CALL[11:], "\n", second]
    _, events = await ask(client, fake_worker, pieces, stream=True)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Checking"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 0, 1, 1]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert json.loads(calls[3]["function"]["arguments"]) == {"city": "Oslo"}
    assert "id" not in calls[1] and calls[2]["id"] != calls[0]["id"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
