"""The one sampling-parameters type: parsed by the gateway, carried as a dict, taken by the sampler.

Adding a field is one line here plus its use: the type check, `to_dict` and `from_dict` follow the
field's annotation. Ranges are checked once, in `__post_init__`, with a ValueError naming the field
(the worker turns it into an error reply; the gateway checks its own, stricter, limits first).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, fields
from typing import Any, get_args, get_origin, get_type_hints

_SEED_RANGE = range(-(2**63), 2**64)  # what a signed or unsigned 64-bit seed can be
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows
MAX_CHOICES = 16  # n: choices per request (each holds a batch slot)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # None: the engine draws one when the request starts
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Penalties on what the request generated (OpenAI): logit -= frequency * count + presence *
    # (count > 0). repetition_penalty (vLLM/TGI's extension, as in CTRL) divides the positive
    # logits of tokens seen in the prompt or the output by it and multiplies the negative ones.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # no stop token (EOS included) before this many output tokens
    # Log-probs of each sampled token plus this many alternatives (None: none). They come from
    # the logits after penalties and bias, before temperature and top-k/top-p (engine/sampler.py).
    logprobs: int | None = None
    # Log-probs of each prompt token after the first (it has no context), plus this many
    # alternatives (None: none); computed from the model's raw logits. The request's prompt is
    # then computed in full (no prefix-cache hit), as its every position needs logits.
    prompt_logprobs: int | None = None
    # Choices generated for the one prompt: it is prefilled once and its KV blocks are shared.
    n: int = 1
    # An llguidance grammar (JSON, built by generation.grammar) every output token must follow;
    # the request finishes ("stop") once the grammar is complete.
    grammar: str | None = None
    # False: the engine returns token ids only and leaves text and stop strings to the caller
    # (the gateway detokenizes what it serves, off the worker's step; vLLM has the same field).
    detokenize: bool = True
    # The tokens the caller expects the output to be, mostly (OpenAI's Predicted Outputs): with
    # speculation on, drafted from first; the tokens are the model's own picks either way.
    prediction_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name, annotation in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not _conforms(value, annotation):
                got = "" if isinstance(value, tuple) else f", got {type(value).__name__}"
                raise ValueError(f"{name} must be {_describe(annotation)}{got}")
            if annotation is float:  # JSON writes 1.0 as 1; keep one spelling
                object.__setattr__(self, name, float(value))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and self.seed not in _SEED_RANGE:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if any(t < 0 for t in self.prediction_token_ids):
            raise ValueError("prediction_token_ids must be >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise ValueError("logit_bias maps token ids >= 0 to values in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")
        if self.grammar is not None and not self.grammar:
            raise ValueError("grammar must be non-empty when given")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before it picks a token."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples become lists."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in fields(self)
        }

    @classmethod
    def from_dict(cls, data: object) -> SamplingParams:
        """The wire form back; unknown or ill-typed fields raise ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling must be an object, got {type(data).__name__}")
        unknown = sorted(map(str, data.keys() - _FIELD_TYPES.keys()))
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**{k: _tuples(v) if _is_list_field(k, v) else v for k, v in data.items()})


def _is_list_field(name: str, value: object) -> bool:
    return isinstance(value, list) and get_origin(_FIELD_TYPES[name]) is tuple


def _tuples(value: object) -> object:
    """JSON lists back to the tuples the fields hold, nested ones too (logit_bias)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _conforms(value: object, annotation: Any) -> bool:
    """isinstance for the few annotations sampling fields use; bool is not an int here."""
    if isinstance(annotation, types.UnionType):
        return any(_conforms(value, a) for a in get_args(annotation))
    if get_origin(annotation) is tuple:
        args = get_args(annotation)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
            return all(_conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(_conforms, value, args))  # tuple[X, Y]
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", None: "null"}


def _describe(annotation: Any) -> str:
    """How a field's type reads on the wire: 'an integer or null', 'a list of strings'."""
    if isinstance(annotation, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(annotation))
    if get_origin(annotation) is tuple:
        args = get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            item = get_args(args[0])
            if get_origin(args[0]) is tuple:  # pairs
                return f"a list of [{', '.join(_describe(a).split()[-1] for a in item)}] pairs"
            return f"a list of {_describe(args[0]).split()[-1]}s"
        return f"a [{', '.join(_describe(a).split()[-1] for a in args)}] pair"
    return _NAMES[None if annotation is type(None) else annotation]


_FIELD_TYPES: dict[str, Any] = get_type_hints(SamplingParams)
