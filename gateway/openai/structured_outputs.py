"""Structured outputs: the request fields that constrain the output to a grammar.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's extensions, under
both of vLLM's spellings: the `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` fields, and their newer `structured_outputs` object (`json`, `regex`,
`choice`, `grammar`, `json_object`). At most one may be given. Their shapes are the models
below; the grammar string is built from the validated fields (generation.grammar) and compiled
against the model's tokenizer in gateway.serving.request_path, where a grammar that does not
compile is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, PrivateAttr, Strict, model_validator

from gateway.openai.errors import bad_request
from gateway.openai.field_types import Boolean, NonEmptyText, String, absent_is_null, check
from gateway.openai.validation import Invalid, expect
from generation import grammar as g

MAX_ERROR_CHARS = 200
_QUOTED = re.compile(r'"[^"]*"|\'[^\']*\'')
FORMAT_TYPES = "must be one of text, json_object, json_schema"


@dataclass(frozen=True, slots=True)
class Grammar:
    text: str  # the llguidance grammar (SamplingParams.grammar)
    param: str  # the request field it came from, for a 400 when it does not compile


def _json_text(value: Any) -> Any:
    """vLLM takes guided_json as a JSON string too."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        raise Invalid("is not valid JSON") from None


JsonSchema = Annotated[
    dict[str, Any], expect("must be a JSON schema object"), BeforeValidator(_json_text)
]
Choices = Annotated[list[Any], Strict(), expect("must be a list of strings")]  # items: g.choice
JsonObject = Annotated[bool, Strict(), expect("must be true"), check(bool, "must be true")]


class JsonSchemaFormat(BaseModel):
    name: String | None = None
    strict: Boolean | None = None  # enforced either way: the output follows a grammar
    schema_: Annotated[dict[str, Any], expect("must be a JSON schema object")] | None = Field(
        None,
        alias="schema",  # "schema" would shadow a BaseModel method
    )

    @model_validator(mode="after")
    def _schema_given(self) -> JsonSchemaFormat:
        if self.schema_ is None:
            raise Invalid("must be a JSON schema object", field="schema")
        return self


class ResponseFormat(BaseModel):
    type: Annotated[Literal["text", "json_object", "json_schema"], expect(FORMAT_TYPES)] = (
        absent_is_null()
    )
    json_schema: Annotated[JsonSchemaFormat, expect("must be an object")] | None = None

    @model_validator(mode="before")
    @classmethod
    def _json_schema_read_for_its_type_only(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise Invalid(message=f"'response_format.type' {FORMAT_TYPES}.")
        if data.get("type") != "json_schema":
            return {k: v for k, v in data.items() if k != "json_schema"}
        return data

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise Invalid("must be an object", field="json_schema")
        return self


# vLLM's newer spelling: structured_outputs.<key> means the same as the older field
_NEW_NAMES = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "json_object": "json_object",
}


class StructuredOutputs(BaseModel):
    json_: JsonSchema | None = Field(None, alias="json")
    regex: NonEmptyText | None = None
    choice: Choices | None = None
    grammar: NonEmptyText | None = None
    json_object: JsonObject | None = None
    given_order: tuple[str, ...] = ()  # the keys as the client wrote them (not a request field)

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        """null and false mean not given; anything else unknown (structural_tag, ...) is
        refused, not dropped."""
        if not isinstance(data, dict):
            return data
        given = {k: v for k, v in data.items() if v is not None and v is not False}
        if given.keys() - _NEW_NAMES.keys():
            supported = ", ".join(_NEW_NAMES)
            raise Invalid(f"holds a field this server does not support; supported: {supported}")
        return {**given, "given_order": tuple(given)}

    def given(self) -> list[tuple[str, Any]]:
        """(request field, value) of each format given here, in the client's order."""
        return [
            (f"structured_outputs.{key}", getattr(self, "json_" if key == "json" else key))
            for key in self.given_order
        ]


class OutputFormatFields(BaseModel):
    """The output-format fields of both routes; `grammar` is what they ask for, if anything."""

    response_format: ResponseFormat | None = None
    guided_json: JsonSchema | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Choices | None = None
    guided_grammar: NonEmptyText | None = None
    structured_outputs: Annotated[StructuredOutputs, expect("must be an object")] | None = None
    _grammar: Grammar | None = PrivateAttr(None)

    @property
    def grammar(self) -> Grammar | None:
        return self._grammar

    @model_validator(mode="after")
    def _build_grammar(self) -> OutputFormatFields:
        self._grammar = output_grammar(self)
        return self


def output_grammar(fields: OutputFormatFields) -> Grammar | None:
    """The grammar the fields ask for (one format at most), or an `Invalid` naming the field."""
    found = [(name, getattr(fields, name)) for name in _FIELDS if getattr(fields, name) is not None]
    if fields.structured_outputs is not None:
        found += fields.structured_outputs.given()
    if found and found[0][0] == "response_format" and found[0][1].type == "text":
        found = found[1:]  # plain text: no grammar
    if len(found) > 1:
        raise Invalid(
            f"cannot be combined with '{found[0][0]}': give one output format", field=found[1][0]
        )
    if not found:
        return None
    [(param, value)] = found
    try:
        return Grammar(_build(param, value), param)
    except g.GrammarError as e:
        raise Invalid(str(e), field=param) from None


def compile_error(grammar: Grammar, error: str) -> Exception:
    """The 400 for a grammar llguidance would not compile: the first line of its message,
    bounded, with what it quotes of the input left out (errors do not echo input)."""
    lines = error.splitlines() or ["invalid"]
    # The first line, and the regex parser's own "error: ..." line (the others quote the input).
    lines = [lines[0], *(line for line in lines[1:] if line.startswith("error:"))]
    reason = _QUOTED.sub('"..."', " ".join(lines))
    return bad_request(
        f"'{grammar.param}' is not a valid grammar: {reason[:MAX_ERROR_CHARS]}", grammar.param
    )


_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _build(param: str, value: Any) -> str:
    kind = _NEW_NAMES.get(param.removeprefix("structured_outputs."), param)
    if kind == "response_format":
        if value.type == "json_object":
            return g.json_object()
        return g.json_schema(value.json_schema.schema_ or {})  # given: checked above
    if kind == "json_object":
        return g.json_object()
    if kind == "guided_json":
        return g.json_schema(value)
    if kind == "guided_choice":
        return g.choice(value)
    return g.regex(value) if kind == "guided_regex" else g.lark(value)
