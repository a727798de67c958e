"""The fields both generation routes share: the model, streaming, and every sampling field but
max_tokens (whose name and default depend on the route), as `SamplingParams` for the wire."""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Self

from annotated_types import Ge, Le
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.openai.chat_messages import Prediction
from gateway.openai.field_types import (
    INT64,
    MAX_TOKEN_ID,
    POSITIVE,
    SURROGATE,
    UNICODE,
    Flag,
    Integer,
    NonEmptyText,
    Number,
    TokenIds,
    at_most,
    at_most_given,
    between,
    check,
    encodable,
    none_is,
)
from gateway.openai.validation import Invalid, expect
from generation import SamplingParams
from generation.sampling_params import MAX_CHOICES, MAX_LOGPROBS
from protocol import PRIORITIES
from protocol.sampling_defaults import FIELDS as DEFAULTABLE
from protocol.sampling_defaults import SamplingDefaults

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # the detokenizer holds back this much text while a stop may be forming
MAX_STOP_TOKEN_IDS = 256
MAX_MODEL_NAME_CHARS = 256
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


def _one_or_list(value: Any) -> Any:
    return [] if value is None else [value] if isinstance(value, str) else value


STOP_SHAPE = "must be a non-empty string or a list of them"
Stop = Annotated[
    list[Annotated[str, Strict()]],
    expect(STOP_SHAPE, nested=True),
    check(all, STOP_SHAPE),
    at_most(MAX_STOP_STRINGS, f"may hold at most {MAX_STOP_STRINGS} strings"),
    check(
        lambda stops: all(len(s) <= MAX_STOP_CHARS for s in stops),
        message=f"Each 'stop' string must be at most {MAX_STOP_CHARS} characters.",
    ),
    check(lambda stops: all(encodable(s) for s in stops), SURROGATE),
    BeforeValidator(_one_or_list),
]


def _is_token_id(key: str) -> bool:
    # the length first (leading zeros aside): int() of a key over 4300 digits raises
    return (
        key.isascii() and key.isdigit() and len(key.lstrip("0")) <= 10 and int(key) <= MAX_TOKEN_ID
    )


def _sorted_pairs(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    return tuple(sorted((int(key), value) for key, value in bias.items()))


# OpenAI's {"token id": bias in [-100, 100]} (ids as strings: JSON keys)
LogitBias = Annotated[
    dict[
        Annotated[str, check(_is_token_id, "keys must be token ids (integers >= 0)")],
        Annotated[
            float,
            Strict(),
            AllowInfNan(False),
            Ge(-100),
            Le(100),
            expect("values must be numbers in [-100, 100]"),
        ],
    ],
    expect("must be an object of token ids to numbers", nested=True),
    AfterValidator(_sorted_pairs),
    at_most_given(dict, MAX_LOGIT_BIAS, f"may hold at most {MAX_LOGIT_BIAS} entries"),
    none_is({}),
]
ModelName = Annotated[
    NonEmptyText,
    at_most(MAX_MODEL_NAME_CHARS, f"must be at most {MAX_MODEL_NAME_CHARS} characters"),
    UNICODE,
]
AnyInt = Annotated[Integer, between(-INT64, INT64 - 1)]
Count = Annotated[Integer, between(0, INT64 - 1)]
MaxTokens = Annotated[Integer, between(1, INT64 - 1)]
Logprobs = Annotated[Integer, between(0, MAX_LOGPROBS)]


class StreamOptions(BaseModel):
    include_usage: Flag = False


class GenerationFields(BaseModel):
    """What both routes take (each route adds its prompt, max_tokens and log-probs fields)."""

    model: ModelName | None = None
    stream: Flag = False
    stream_options: Annotated[StreamOptions, expect("must be an object")] | None = None
    n: Annotated[Integer, between(1, MAX_CHOICES), none_is(1)] = 1
    temperature: Annotated[Number, between(0.0, 2.0), none_is(1.0)] = 1.0
    top_p: Annotated[Number, between(0.0, 1.0), POSITIVE, none_is(1.0)] = 1.0  # 0 keeps nothing
    top_k: Annotated[Integer, between(-1, INT64 - 1)] | None = None  # -1 (as 0): off
    seed: AnyInt | None = None
    stop: Stop = Field(default_factory=list)
    stop_token_ids: Annotated[
        TokenIds,
        at_most(MAX_STOP_TOKEN_IDS, f"may hold at most {MAX_STOP_TOKEN_IDS} ids"),
        none_is([]),
    ] = Field(default_factory=list)
    ignore_eos: Flag = False
    presence_penalty: Annotated[Number, between(-2.0, 2.0), none_is(0.0)] = 0.0
    frequency_penalty: Annotated[Number, between(-2.0, 2.0), none_is(0.0)] = 0.0
    repetition_penalty: Annotated[Number, between(0.0, 10.0), POSITIVE, none_is(1.0)] = 1.0
    # Kept as sorted (token id, bias) pairs; the ids are checked against the vocabulary later.
    logit_bias: LogitBias = ()
    min_tokens: Annotated[Count, none_is(0)] = 0  # against max_tokens once it is resolved
    # OpenAI's chat `prediction` (Predicted Outputs), taken by completions too: the text the
    # reply is expected to repeat; tokenized by the request path.
    prediction: Prediction | None = None
    # vLLM's `priority`: lower is served first; the Batch API's lines run below every range.
    priority: Annotated[Integer, between(PRIORITIES[0], PRIORITIES[-1] - 1)] | None = None
    # The defaultable fields the request sent with a value (null is "not given", as clients
    # send it): these keep their value; the others take the model's defaults (with_defaults).
    _sent: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="wrap")
    @classmethod
    def _note_sent(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        request = handler(data)
        if isinstance(data, dict):
            request._sent = frozenset(k for k in DEFAULTABLE if data.get(k) is not None)
        return request

    @field_validator("stream_options", mode="before")
    @classmethod
    def _only_when_streaming(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, dict) and info.data.get("stream") is False:
            raise Invalid("is only allowed with 'stream': true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        """Log-probs asked for: alternatives per token (0: the chosen token's only). Each
        route's model answers from its own fields (request_models.py: completions' `logprobs`,
        chat's `logprobs` + `top_logprobs`)."""
        raise NotImplementedError

    def with_defaults(self, defaults: SamplingDefaults, room: int) -> Self:
        """This request with the model's defaults in the sampling fields it did not send; a
        value it sent, even the API's default, wins. A default max_tokens is capped to `room`
        (the context left after the prompt), as the chat route's own default is: a default
        never makes a request too long."""
        update: dict[str, Any] = {
            k: v for k, v in defaults.to_dict().items() if k not in self._sent and k != "max_tokens"
        }
        # max_tokens is each route's own field (chat's max_completion_tokens is read into it)
        if defaults.max_tokens is not None and getattr(self, "max_tokens", 0) is None:
            update["max_tokens"] = max(1, min(defaults.max_tokens, room))
        if not update:
            return self
        request = self.model_copy(update=update)
        request.__dict__.pop("sampling", None)  # a copy must not keep the old params' cache
        return request

    @cached_property
    def sampling(self) -> SamplingParams:
        """The wire's sampling parameters; max_tokens and min_tokens are set by
        gateway.serving.request_path once the route's default is known."""
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k or 0, 0),  # OpenAI-style clients send -1 for "off"
            seed=self.seed,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            logprobs=self.num_logprobs,
        )
