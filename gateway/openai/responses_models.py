"""The Responses API's request (POST /v1/responses) as pydantic models: `ResponsesRequest`,
validated in one pass with the API's own field names (a 400 names `input[2].call_id` or
`text.format.schema`, gateway.openai.validation).

A Responses request runs as a chat completion (gateway.openai.responses_input makes it one), so
its sampling fields are the chat route's (`GenerationFields`: vLLM's extras such as seed, top_k
and priority included), its function tools are chat's `FunctionSpec` in the API's flat shape,
and `text.format` becomes chat's response_format; its input items are
gateway.openai.responses_items'. What the API has and this server cannot honour (built-in tools,
background, reasoning, include, truncation "auto", ...) is refused naming the field, never
dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, StrictStr, model_validator

from gateway.openai.field_types import (
    SURROGATE,
    Boolean,
    String,
    Text,
    absent_is_null,
    at_most,
    at_most_given,
    encodable,
    none_is,
    of_type,
    refuse_unsupported,
)
from gateway.openai.generation_fields import GenerationFields, MaxTokens
from gateway.openai.responses_items import MAX_ID_CHARS, Items
from gateway.openai.tools import MAX_TOOLS, FunctionSpec
from gateway.openai.validation import Invalid, expect, validate

MAX_METADATA = 16  # OpenAI's bounds on metadata: pairs, key and value characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512

# Fields of the API this server cannot honour: refused unless absent, null or this "off" value
# (None: any value is refused). `n` is not the API's: one response holds one output.
UNSUPPORTED: dict[str, Any] = {
    "background": False,
    "background_options": None,
    "context_management": None,
    "conversation": None,
    "include": [],
    "max_tool_calls": None,
    "moderation": None,
    "prompt": None,
    "prompt_cache_options": None,
    "prompt_cache_retention": None,
    "reasoning": None,
    "top_logprobs": 0,
    "truncation": "disabled",
    "verbosity": "medium",
    "access_programs": None,
    "image": None,
    "n": 1,
}
# Chat completions' names for what this API spells otherwise: a client mixing them up is told.
CHAT_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


# --- tools, tool_choice, text.format --------------------------------------------------------


class FunctionTool(FunctionSpec):
    """The API's flat function tool: chat's function fields beside `type`. `strict` is
    accepted; arguments follow the schema exactly when the call is forced (a grammar), as on
    the chat route."""

    strict: Boolean | None = None

    def echo(self) -> dict[str, Any]:
        return {**self.spec()["function"], "type": "function", "strict": self.strict}


BUILTIN = "must be a function tool (type: function); built-in tools are not supported"
Tools = Annotated[
    list[Annotated[FunctionTool, of_type("function", BUILTIN)]],
    expect("must be a list of function tools"),
    at_most_given(list, MAX_TOOLS, f"may hold at most {MAX_TOOLS} tools"),
    none_is([]),
]


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: StrictStr


CHOICE_RULE = 'must be none, auto, required or {"type": "function", "name": ...}'
ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedFunction, expect(CHOICE_RULE, nested=True)
]
FORMAT_TYPES = "must be one of text, json_object, json_schema"


class TextFormat(BaseModel):
    type: Annotated[Literal["text", "json_object", "json_schema"], expect(FORMAT_TYPES)] = (
        absent_is_null()
    )
    name: String | None = None
    description: String | None = None
    strict: Boolean | None = None  # enforced either way: the output follows a grammar
    schema_: Annotated[dict[str, Any], expect("must be a JSON schema object")] | None = Field(
        None, alias="schema"
    )

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise Invalid("must be a JSON schema object", field="schema")
        return self

    def response_format(self) -> dict[str, Any]:
        """Chat's response_format for the same output."""
        if self.type != "json_schema":
            return {"type": self.type}
        json_schema = {"name": self.name or "response", "schema": self.schema_}
        return {"type": "json_schema", "json_schema": {**json_schema, "strict": self.strict}}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    format: Annotated[TextFormat, expect("must be an object")] | None = None
    verbosity: Annotated[Literal["medium"], expect("is not supported by this server")] | None = None


def _metadata_pairs(value: dict[str, str]) -> dict[str, str]:
    if any(len(k) > MAX_METADATA_KEY for k in value) or any(
        len(v) > MAX_METADATA_VALUE for v in value.values()
    ):
        raise Invalid(
            f"keys must be at most {MAX_METADATA_KEY} characters, values {MAX_METADATA_VALUE}"
        )
    if not all(encodable(k) and encodable(v) for k, v in value.items()):
        raise Invalid(SURROGATE)
    return value


Metadata = Annotated[
    dict[StrictStr, StrictStr],
    expect("must be an object of string values"),
    AfterValidator(_metadata_pairs),
    at_most_given(dict, MAX_METADATA, f"may hold at most {MAX_METADATA} pairs"),
]
Id = Annotated[Text, at_most(MAX_ID_CHARS, f"must be at most {MAX_ID_CHARS} characters")]


# --- the request ----------------------------------------------------------------------------


class ResponsesRequest(GenerationFields):
    input: Items = absent_is_null()
    instructions: Text | None = None
    max_output_tokens: MaxTokens | None = None
    tools: Tools = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Annotated[Boolean, none_is(True)] = True
    text: Annotated[TextConfig, expect("must be an object")] | None = None
    store: Annotated[Boolean, none_is(True)] = True
    previous_response_id: Id | None = None
    metadata: Metadata | None = None
    user: Id | None = None
    safety_identifier: Id | None = None
    prompt_cache_key: Id | None = None  # a routing hint; prefix caching here is automatic
    service_tier: (
        Annotated[Literal["auto", "default"], expect("must be auto or default (no other tiers)")]
        | None
    ) = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, ours in CHAT_NAMES.items():
                if data.get(name) is not None:
                    raise Invalid(f"is a chat completions field; this API's is '{ours}'", name)
        return refuse_unsupported(data, UNSUPPORTED)

    @property
    def text_format(self) -> TextFormat | None:
        return None if self.text is None else self.text.format

    @property
    def num_logprobs(self) -> int | None:
        return None  # top_logprobs is refused (UNSUPPORTED)


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    return validate(ResponsesRequest, body)
