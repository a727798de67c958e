"""Reasoning over HTTP, the test playing the worker (scripted token streams): `--reasoning-parser`
splits a chat's output into `reasoning_content` and content, whole and streamed, with markers
split across replies; tool calls and structured outputs read the content only; the usage counts
the reasoning's tokens; the Responses API answers a reasoning item; `chat_template_kwargs`
reach the template, and bad ones are 400s."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from protocol import ModelCard, RequestMessage
from protocol.model_card import card_from_tokenizer
from tests.gateway.helpers import (
    MODEL,
    TOKENIZER,
    FakeWorker,
    MakeClient,
    assert_openai_error,
    replies_for,
    sse_events,
    tokens,
)
from tests.gateway.responses_helpers import Client, create

SECRET = "SECRET-5b2e"  # planted in bad input: no error may repeat it
# Qwen3's way: `enable_thinking: false` closes the reasoning in the prompt; `think_in_prompt`
# opens it there (DeepSeek-R1's and Qwen3.5's way); an assistant's earlier reasoning is shown.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif think_in_prompt %}<think>\n{% endif %}{% endif %}"
    "{% if count %}{{ count + 1 }}{% endif %}"
)
USER = [{"role": "user", "content": "What is 2 + 2?"}]
# The markers cut inside, across replies.
PIECES = ["<thi", "nk>\nstep ", "one\n</th", "ink>\n\nIt is", " 4."]
REASONING_TOKENS = sum(len(tokens(p)) for p in PIECES[:3]) + len(tokens("ink>"))
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def card(tokenizer: PreTrainedTokenizerFast) -> ModelCard:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATE,
    )
    return card_from_tokenizer(MODEL, tok, 4096, [tok.eos_token_id])


@pytest.fixture
async def client(served: Any, make_client: MakeClient) -> Client:
    return await make_client(reasoning_parsers=(("", "qwen3"),))


async def chat(
    client: Client, worker: FakeWorker, pieces: list[str], finish: str = "stop", **fields: Any
) -> tuple[RequestMessage, Any]:
    body = {"messages": USER, **fields}
    call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    request = await worker.take()
    await worker.reply(request, *replies_for(request, pieces, finish))
    response = await call
    assert response.status == 200, await response.text()
    if fields.get("stream"):
        return request, sse_events(await response.text())
    return request, await response.json()


async def test_a_chat_answer_splits_into_reasoning_and_content(
    client: Client, fake_worker: FakeWorker
) -> None:
    _, out = await chat(client, fake_worker, PIECES)
    [choice] = out["choices"]
    message = choice["message"]
    assert message["content"] == "It is 4." and choice["finish_reason"] == "stop"
    assert message["reasoning_content"] == message["reasoning"] == "step one"
    usage = out["usage"]
    assert usage["completion_tokens"] == sum(len(tokens(p)) for p in PIECES)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": REASONING_TOKENS}


async def test_a_stream_sends_reasoning_deltas_before_content_deltas(
    client: Client, fake_worker: FakeWorker
) -> None:
    _, events = await chat(
        client, fake_worker, PIECES, stream=True, stream_options={"include_usage": True}
    )
    deltas = [e["choices"][0]["delta"] for e in events[:-2] if e["choices"]]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    content = [d["content"] for d in deltas if d.get("content")]
    assert "".join(reasoning) == "step one" and "".join(content) == "It is 4."
    assert all(d["reasoning"] == d["reasoning_content"] for d in deltas if "reasoning" in d)
    assert not any("content" in d and "reasoning" in d for d in deltas[1:])  # after the role
    last = max(i for i, d in enumerate(deltas) if "reasoning" in d)
    assert last < min(i for i, d in enumerate(deltas) if d.get("content"))
    assert events[-2]["usage"]["completion_tokens_details"]["reasoning_tokens"] == REASONING_TOKENS


async def test_tool_calls_are_read_in_the_content_only(
    client: Client, fake_worker: FakeWorker
) -> None:
    """A call written while reasoning is reasoning text; the one after it is the call."""
    pieces = [f"<think>maybe {CALL[:30]}", f"{CALL[30:]}</think>", CALL]
    _, out = await chat(client, fake_worker, pieces, tools=[WEATHER])
    [choice] = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == f"maybe {CALL}" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


async def test_enable_thinking_false_reaches_the_template_and_the_output_is_content(
    client: Client, fake_worker: FakeWorker
) -> None:
    kwargs = {"enable_thinking": False}
    request, out = await chat(
        client, fake_worker, ["<think>x</think>", " y"], chat_template_kwargs=kwargs
    )
    assert TOKENIZER.decode(request.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    message = out["choices"][0]["message"]
    assert message["content"] == "<think>x</think> y" and message["reasoning_content"] is None
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


async def test_a_prompt_that_opens_the_reasoning_starts_the_output_in_it(
    client: Client, fake_worker: FakeWorker
) -> None:
    """Cut by max_tokens before its end marker: all reasoning, no content."""
    kwargs = {"think_in_prompt": True}
    _, out = await chat(
        client, fake_worker, ["still ", "thinking"], "length", chat_template_kwargs=kwargs
    )
    [choice] = out["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "still thinking"


async def test_structured_outputs_constrain_the_content_after_the_reasoning(
    client: Client, fake_worker: FakeWorker
) -> None:
    """The worker's grammar lets the reasoning run free (it ends at the marker), then the
    format; with the reasoning closed in the prompt it is the format alone."""
    fields = {"response_format": {"type": "json_object"}}
    request, out = await chat(client, fake_worker, ['<think>hm</think>{"a":', "1}"], **fields)
    assert '"name":"jitney_content"' in request.sampling_params.grammar
    assert out["choices"][0]["message"]["content"] == '{"a":1}'
    closed = {"enable_thinking": False}
    request, _ = await chat(client, fake_worker, ["{}"], chat_template_kwargs=closed, **fields)
    assert "jitney_content" not in request.sampling_params.grammar


async def test_an_assistant_s_earlier_reasoning_reaches_the_template(
    client: Client, fake_worker: FakeWorker
) -> None:
    """As sent back: `reasoning_content`, or vLLM's `reasoning`."""
    for name in ("reasoning_content", "reasoning"):
        messages = [*USER, {"role": "assistant", "content": "4", name: "I added."}, *USER]
        request, _ = await chat(client, fake_worker, ["ok"], messages=messages)
        assert "<think>I added.</think>4" in TOKENIZER.decode(request.prompt_token_ids)


async def test_without_a_parser_the_output_is_returned_as_written(
    served: Any, make_client: MakeClient, fake_worker: FakeWorker
) -> None:
    plain = await make_client()
    _, out = await chat(plain, fake_worker, PIECES)
    message = out["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "".join(PIECES)}
    assert "completion_tokens_details" not in out["usage"]


# --- the Responses API ------------------------------------------------------------------------


async def test_a_response_has_a_reasoning_item_then_its_message(
    client: Client, fake_worker: FakeWorker
) -> None:
    _, out = await create(client, fake_worker, PIECES, input="What is 2 + 2?")
    reasoning, message = out["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "step one"}]
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    assert message["content"][0]["text"] == "It is 4."
    assert out["usage"]["output_tokens_details"] == {"reasoning_tokens": REASONING_TOKENS}


async def test_a_response_stream_sends_the_reasoning_text_events(
    client: Client, fake_worker: FakeWorker
) -> None:
    _, events = await create(client, fake_worker, PIECES, input="What is 2 + 2?", stream=True)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in deltas) == "step one"
    assert {(e["output_index"], e["content_index"]) for e in deltas} == {(0, 0)}
    first = kinds.index("response.reasoning_text.delta")
    done = kinds.index("response.reasoning_text.done")
    assert kinds[first - 2 : first] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[done : done + 3] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert done < kinds.index("response.output_text.delta")
    assert events[done]["text"] == "step one"
    assert events[first - 1]["part"] == {"type": "reasoning_text", "text": ""}
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]


async def test_a_stored_reasoning_item_comes_back_with_its_assistant_message(
    client: Client, fake_worker: FakeWorker
) -> None:
    """Continued (previous_response_id): the reasoning is the assistant message's
    `reasoning_content`, which the template shows."""
    _, first = await create(client, fake_worker, PIECES, input="What is 2 + 2?")
    request, _ = await create(
        client, fake_worker, ["ok"], input="And 3 + 3?", previous_response_id=first["id"]
    )
    assert "<think>step one</think>It is 4." in TOKENIZER.decode(request.prompt_token_ids)


async def test_responses_pass_chat_template_kwargs_to_the_template(
    client: Client, fake_worker: FakeWorker
) -> None:
    request, out = await create(
        client,
        fake_worker,
        ["plain"],
        input="Hi",
        chat_template_kwargs={"enable_thinking": False},
    )
    assert TOKENIZER.decode(request.prompt_token_ids).endswith("</think>\n\n")
    assert [item["type"] for item in out["output"]] == ["message"]


# --- bad chat_template_kwargs -----------------------------------------------------------------

BAD: list[tuple[str, Any, str]] = [
    ("/v1/chat/completions", [SECRET], "chat_template_kwargs"),
    ("/v1/chat/completions", SECRET, "chat_template_kwargs"),
    ("/v1/chat/completions", 5, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": SECRET}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"x": SECRET + "\ud800"}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"count": SECRET}, "messages"),  # the template misuses it
    ("/v1/chat/completions", {"count": [SECRET]}, "messages"),
    ("/v1/responses", [SECRET], "chat_template_kwargs"),
    ("/v1/responses", {"tools": SECRET}, "chat_template_kwargs"),
    ("/v1/responses", {"count": SECRET}, "input"),
]


@pytest.mark.parametrize(("route", "kwargs", "param"), BAD)
async def test_bad_chat_template_kwargs_are_a_400_that_quotes_nothing(
    client: Client, route: str, kwargs: Any, param: str
) -> None:
    body: dict[str, Any] = {"chat_template_kwargs": kwargs}
    body |= {"messages": USER} if route.endswith("completions") else {"input": "Hi"}
    raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as \ud800
    response = await client.post(route, data=raw, headers={"Content-Type": "application/json"})
    text = await response.text()
    assert response.status == 400, text
    assert SECRET not in text
    assert_openai_error(json.loads(text), param)
