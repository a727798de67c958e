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
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    Strict,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.openai.chat_messages import Messages, TemplateKwargs
from gateway.openai.field_types import (
    INT64,
    MAX_TOKEN_ID,
    NON_EMPTY,
    REQUIRED,
    SURROGATE,
    UNICODE,
    Flag,
    Integer,
    TokenIds,
    absent_is_null,
    encodable,
    refuse_unsupported,
)
from gateway.openai.generation_fields import AnyInt, GenerationFields, Logprobs, MaxTokens
from gateway.openai.structured_outputs import OutputFormatFields
from gateway.openai.tools import ToolFields
from gateway.openai.validation import Invalid, expect, validate


def _one_prompt(value: Any) -> Any:
    """A list of one prompt is that prompt (its errors and its answer are the single one's)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        return value[0]
    return value


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    if value and all(isinstance(v, str) for v in value):
        return "texts"
    if value and all(isinstance(v, list) for v in value):
        return "id_lists"
    if not any(isinstance(v, str | list) for v in value):
        return "ids"  # token ids (or an empty list, which its check refuses)
    return None  # strings and lists mixed, or with ids


def _each_text(texts: list[str]) -> list[str]:
    for i, text in enumerate(texts):
        if not text:
            raise Invalid(message=f"'prompt[{i}]' must not be empty.")
        if not encodable(text):
            raise Invalid(message=f"'prompt[{i}]' {SURROGATE}.")
    return texts


def _each_ids(id_lists: list[list[int]]) -> list[list[int]]:
    for i, ids in enumerate(id_lists):
        if not ids:
            raise Invalid(message=f"'prompt[{i}]' must not be empty.")
        if not all(0 <= token <= MAX_TOKEN_ID for token in ids):
            raise Invalid(
                message=f"'prompt[{i}]' must be a list of integers between 0 and {MAX_TOKEN_ID}."
            )
    return id_lists


StrictInt = Annotated[int, Strict()]
# One prompt (text or token ids), or several (texts, or lists of token ids: not mixed). A
# several-prompt list's items are checked here so that an error names the item; their count is
# bounded in gateway.serving.request_path (a setting), their ids checked against the vocabulary.
Prompt = Annotated[
    Annotated[str, NON_EMPTY, UNICODE, Tag("text")]
    | Annotated[TokenIds, NON_EMPTY, Tag("ids")]
    | Annotated[list[Annotated[str, Strict()]], AfterValidator(_each_text), Tag("texts")]
    | Annotated[list[list[StrictInt]], AfterValidator(_each_ids), Tag("id_lists")],
    Discriminator(_prompt_kind),
    expect(
        "must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        nested=True,
    ),
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

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts in order: one, or the list's (each answered as if sent alone)."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class ChatCompletionRequest(OutputFormatFields, ToolFields, GenerationFields):
    messages: Annotated[Messages, REQUIRED] = absent_is_null()
    max_completion_tokens: MaxTokens | None = None
    max_tokens: MaxTokens | None = None  # None: the route's default (request_path resolves it)
    logprobs: Flag = False
    top_logprobs: Logprobs | None = None  # alternatives per token, with logprobs: true
    # vLLM's: arguments to the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: TemplateKwargs = Field(default_factory=dict)

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
