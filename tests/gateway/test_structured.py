"""Structured outputs: grammars built from each request field, compiled against the tiny model's
tokenizer, what they accept; malformed and invalid ones refused with a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient
from llguidance import LLMatcher, LLTokenizer
from transformers import PreTrainedTokenizerFast

from gateway.openai.errors import ApiError
from gateway.openai.structured_outputs import Grammar, OutputFormatFields
from gateway.openai.validation import validate
from generation import grammar as g
from tests.gateway.helpers import REQUESTS, FakeWorker, assert_openai_error

Client = TestClient[Any, Any]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def parse_grammar(fields: dict[str, Any]) -> Grammar | None:
    """The output-format fields of a request alone, validated as the request's are."""
    return validate(OutputFormatFields, fields).grammar


@pytest.fixture(scope="module")
def lltok(tokenizer: PreTrainedTokenizerFast) -> LLTokenizer:
    json_ = tokenizer.backend_tokenizer.to_str()
    return g.make_tokenizer(json_, len(tokenizer), [tokenizer.eos_token_id])


def accepts(
    grammar: str, text: str, lltok: LLTokenizer, tokenizer: PreTrainedTokenizerFast
) -> bool:
    """Whether `text` is a complete output of `grammar` (token by token, as a worker checks)."""
    matcher = LLMatcher(lltok, grammar)
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


# (request fields, an output it accepts, one it refuses)
GOOD: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": {"type": "json_object"}}, '{"a":[1,2]}', '{"a": 1}'),  # compact only
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": SCHEMA},
            }
        },
        '{"city":"Paris","days":3}',
        '{"city":"Paris"}',
    ),
    ({"guided_json": SCHEMA}, '{"city":"Oslo","days":1}', '{"days":1}'),
    ({"guided_json": json.dumps(SCHEMA)}, '{"city":"Oslo","days":1}', "[]"),  # a JSON string
    ({"guided_regex": r"[0-9]{3}-[a-z]+"}, "123-abc", "12-abc"),
    ({"guided_choice": ["yes", "no", "é"]}, "é", "maybe"),
    ({"guided_grammar": 'start: "a" b+\nb: "b"'}, "abbb", "ab a"),
    ({"guided_grammar": 'root ::= "x" [0-9]'}, "x7", "x"),  # GBNF
    ({"structured_outputs": {"regex": "a+"}}, "aaa", "b"),
    ({"structured_outputs": {"json_object": True}}, "{}", "[]"),
]


@pytest.mark.parametrize(("fields", "good", "bad"), GOOD)
def test_grammars_compile_and_constrain(
    fields: dict[str, Any],
    good: str,
    bad: str,
    lltok: LLTokenizer,
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    grammar = parse_grammar(fields)
    assert grammar is not None
    assert grammar.param.partition(".")[0] == next(iter(fields))
    assert g.validate(grammar.text, lltok) is None
    assert accepts(grammar.text, good, lltok, tokenizer)
    assert not accepts(grammar.text, bad, lltok, tokenizer)


def test_text_and_no_format_need_no_grammar() -> None:
    assert parse_grammar({}) is None
    assert parse_grammar({"response_format": {"type": "text"}}) is None
    assert parse_grammar({"response_format": {"type": "text"}, "guided_regex": "a"}) is not None


# (fields, the param the 400 names): refused when parsed, before any tokenizer is needed
MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}},
        "response_format.json_schema.strict",
    ),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_grammar": "garbage (("}, "guided_grammar"),  # neither Lark nor GBNF
    ({"guided_json": {"type": "string", "pattern": "x" * (g.MAX_SCHEMA_BYTES + 1)}}, "guided_json"),
    ({"guided_regex": "a" * (g.MAX_SCHEMA_BYTES + 1)}, "guided_regex"),
    ({"guided_json": {"type": "string", "pattern": "\ud800"}}, "guided_json"),  # lone surrogate
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),  # two formats
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
    ({"structured_outputs": [1]}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
]


@pytest.mark.parametrize(("fields", "param"), MALFORMED)
def test_malformed_formats_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_grammar(fields)
    assert e.value.status == 400 and e.value.param == param


def test_deep_schemas_are_refused() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(2000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ApiError) as e:
        parse_grammar({"guided_json": schema})
    assert e.value.param == "guided_json"


# Well-formed requests whose grammar does not compile: found by llguidance, per kind.
INVALID: list[dict[str, Any]] = [
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
    {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
    {"guided_regex": "a(b"},
    {"guided_grammar": "start: undefined_rule"},
    {"structured_outputs": {"grammar": "start: /[/"}},
]


@pytest.mark.parametrize("fields", INVALID)
def test_grammars_that_do_not_compile_are_reported(
    fields: dict[str, Any], lltok: LLTokenizer
) -> None:
    grammar = parse_grammar(fields)
    assert grammar is not None
    error = g.validate(grammar.text, lltok)
    assert error


@pytest.mark.parametrize("fields", INVALID[:3])
async def test_invalid_grammar_is_a_400_before_anything_is_queued(
    client: Client, served: redis.Redis, fields: dict[str, Any]
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    response = await client.post("/v1/chat/completions", json={"messages": messages, **fields})
    assert response.status == 400
    out = await response.json()
    assert_openai_error(out, next(iter(fields)))
    assert "not a valid grammar" in out["error"]["message"]
    assert served.xlen(REQUESTS) == 0


async def test_the_grammar_travels_to_the_worker(client: Client, fake_worker: FakeWorker) -> None:
    body = {"prompt": "x", "response_format": {"type": "json_object"}}
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    request = await fake_worker.take()
    assert request.sampling_params.grammar == g.json_object()
    await fake_worker.answer(request, ['{"a":1}'])
    assert (await (await call).json())["choices"][0]["text"] == '{"a":1}'
