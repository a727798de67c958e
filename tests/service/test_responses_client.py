"""The Responses API with the official `openai` client, unchanged, against the whole system
(redis-server, a tiny-random worker, the gateway): create, stream (raw events and the
`responses.stream` helper), `parse` with a pydantic format, a forced tool call and its output
sent back with previous_response_id, retrieve and delete."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.service.helpers import MODEL
from tests.services import running_system


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with running_system(("rs1",)) as system:
        yield openai.OpenAI(base_url=f"{system.base}/v1", api_key="unused", max_retries=0)


def test_create_is_the_chat_answer_and_is_stored_until_deleted(client):
    """Greedy: the response's text is the chat route's for the same conversation."""
    response = client.responses.create(
        model=MODEL, input="Hello", instructions="Be kind.", max_output_tokens=8, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    want = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == want
    retrieved = client.responses.retrieve(response.id)
    assert retrieved.output_text == response.output_text and retrieved.id == response.id
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_create_stream_yields_the_typed_events(client):
    stream = client.responses.create(
        model=MODEL, input="Hello", max_output_tokens=6, temperature=0, stream=True
    )
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and final.usage.output_tokens == 6


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=9)


def test_the_stream_helper_parses_a_pydantic_format(client):
    """Only the grammar makes random weights answer valid JSON; it ends the output, so the
    response completes."""
    with client.responses.stream(
        model=MODEL,
        input="Pick one.",
        text_format=Pick,
        max_output_tokens=60,
        temperature=1.0,
        extra_body={"seed": 7},  # sampled, and the same draws every run
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Pick)
    assert "".join(deltas) == final.output_text


class Reply(BaseModel):
    answer: str = Field(max_length=12)
    labels: list[bool] = Field(max_length=3)


def test_parse_with_a_pydantic_text_format(client):
    result = client.responses.parse(
        model=MODEL,
        input="Answer in JSON.",
        text_format=Reply,
        max_output_tokens=200,
        extra_body={"seed": 7},  # sampled, and the same draws every run
    )
    assert isinstance(result.output_parsed, Reply) and len(result.output_parsed.answer) <= 12


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def test_a_forced_call_then_its_output_continues_the_conversation(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    first = client.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
        # Greedy: sampled arguments from random weights could run past max_output_tokens (a
        # fresh-clone CI run got a cut-off call back as a message).
        temperature=0,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=tools,
        max_output_tokens=5,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # Its prompt holds the first one's, the call and its output.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output and second.status in ("completed", "incomplete")
