"""The request models without HTTP: pydantic's errors become OpenAI 400s in our words, naming
the field; a bug in a validator stays a bug."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, field_validator

from gateway.openai.errors import ApiError
from gateway.openai.request_models import parse_chat, parse_completion
from gateway.openai.validation import parse_json, validate
from tests.gateway.test_tools import BAD_CHATS, BAD_TOOLS, USER
from tests.gateway.test_validation import BAD_REQUESTS, CHAT


def bodies() -> list[tuple[str, dict[str, Any]]]:
    """Every bad body of the validation and tool tests that parses as JSON."""
    out = []
    for route, body, _ in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8", "surrogatepass")
        try:
            out.append((route, parse_json(raw)))
        except ApiError:
            continue
    out += [(CHAT, {"messages": USER, **fields}) for fields, _ in BAD_TOOLS + BAD_CHATS]
    return out


def test_every_refusal_is_worded_for_its_field() -> None:
    """No field falls back to the generic wording (a field without its own `expect`)."""
    refused = 0
    for route, body in bodies():
        try:
            (parse_chat if route == CHAT else parse_completion)(body)
        except ApiError as e:
            refused += 1
            assert e.status == 400 and e.param, body
            assert not e.message.endswith("is invalid."), (e.message, body)
    assert refused > 100


def test_nested_fields_are_named_as_openai_does() -> None:
    messages = [*USER, {"role": "user", "content": [{"type": "text", "text": 5}]}]
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": messages})
    assert e.value.param == "messages[1].content[0].text"
    assert e.value.message == "'messages[1].content[0].text' must be a string."


def test_a_bug_in_a_validator_is_not_a_400() -> None:
    """A validator that fails by accident raises as it would anywhere (the app answers 500)."""

    class Broken(BaseModel):
        x: int = 0

        @field_validator("x")
        @classmethod
        def _broken(cls, value: int) -> int:
            raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        validate(Broken, {"x": 1})
