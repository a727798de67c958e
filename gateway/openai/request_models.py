"""The two generation requests as pydantic models: `CompletionRequest` (/v1/completions) and
`ChatCompletionRequest` (/v1/chat/completions), each validated in one pass (a 400 naming the
field, gateway.openai.validation).

Only the shape is checked here; what needs the model (token ids in the vocabulary, prompt +
max_tokens within the context window) is checked in gateway.serving.request_path after
tokenizing. Unknown fields are ignored (clients send many optional OpenAI fields); known fields
we cannot honour (suffix, best_of > n, ...) are refused rather than silently ignored. The fields
both routes share are `GenerationFields` (gateway.openai.generation_fields); structured
outputs and tools bring theirs (gateway.openai.structured_outputs, gateway.openai.tools).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Discriminator,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.openai.chat_messages import Messages
from gateway.openai.field_types import (
    INT64,
    NON_EMPTY,
    REQUIRED,
    UNICODE,
    Flag,
    Integer,
    TokenIds,
    absent_is_null,
    refuse_unsupported,
)
from gateway.openai.generation_fields import AnyInt, GenerationFields, Logprobs, MaxTokens
from gateway.openai.structured_outputs import OutputFormatFields
from gateway.openai.tools import ToolFields
from gateway.openai.validation import Invalid, expect, validate


def _one_prompt(value: Any) -> Any:
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) > 1:
            raise Invalid(
                message="Several prompts in one request are not supported; send one per request."
            )
        return value[0]
    return value


def _prompt_kind(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "ids" if isinstance(value, list) else None


Prompt = Annotated[
    Annotated[str, NON_EMPTY, UNICODE, Tag("text")]
    | Annotated[TokenIds, NON_EMPTY, Tag("ids")],  # checked against the vocabulary later
    Discriminator(_prompt_kind),
    expect("must be a string or a list of token ids", nested=True),
    BeforeValidator(_one_prompt),
    REQUIRED,
]


def _false_is_none(value: Any) -> Any:
    return None if value is False else value  # some clients send false for "none"


class CompletionRequest(OutputFormatFields, GenerationFields):
    prompt: Prompt = absent_is_null()
    echo: Flag = False  # the prompt comes back before the completion (with its logprobs)
    best_of: AnyInt | None = None
    # None: the route's default (OpenAI's 16); 0 only with echo (the prompt alone)
    max_tokens: Integer | None = None
    logprobs: Annotated[Logprobs | None, BeforeValidator(_false_is_none)] = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, {"suffix": ""})

    @field_validator("best_of")
    @classmethod
    def _every_candidate_returned(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and "n" in info.data and value != info.data["n"]:
            raise Invalid("must equal 'n' (no candidates are ranked and dropped)")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        lo = 0 if info.data.get("echo") else 1
        if value is not None and not lo <= value <= INT64 - 1:
            raise Invalid(f"must be between {lo} and {INT64 - 1}")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(OutputFormatFields, ToolFields, GenerationFields):
    messages: Annotated[Messages, REQUIRED] = absent_is_null()
    max_completion_tokens: MaxTokens | None = None
    max_tokens: MaxTokens | None = None  # None: the route's default (request_path resolves it)
    logprobs: Flag = False
    top_logprobs: Logprobs | None = None  # alternatives per token, with logprobs: true

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_and_rename(cls, data: Any) -> Any:
        """best_of is not an OpenAI chat field (vLLM's, for beam search): 1 at most.
        max_completion_tokens, when given, is max_tokens (which is then not read)."""
        data = refuse_unsupported(data, {"best_of": 1})
        if isinstance(data, dict) and data.get("max_completion_tokens") is not None:
            return {**data, "max_tokens": data["max_completion_tokens"]}
        return data

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and info.data.get("logprobs") is False:
            raise Invalid("needs 'logprobs': true")
        return value

    @model_validator(mode="after")
    def _tools_with_the_rest(self) -> ChatCompletionRequest:
        """Tools that may be called take no log-probs; a forced call is the output's grammar."""
        config = self.tool_config
        if config is None or not config.offered:
            return self
        if self.num_logprobs is not None:
            raise Invalid("is not supported together with 'tools'", field="logprobs")
        if (forced := config.grammar()) is not None:
            if self.grammar is not None:
                param = self.grammar.param
                raise Invalid("cannot be combined with a forced tool call", field=param)
            self._grammar = forced
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as apply_chat_template takes them (gateway.openai.tools adds the tools)."""
        return [m.template_dict() for m in self.messages]


GenerationRequest = CompletionRequest | ChatCompletionRequest


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    return validate(CompletionRequest, body)


def parse_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    return validate(ChatCompletionRequest, body)
