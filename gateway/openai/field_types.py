"""The field types request bodies are made of: strict JSON types (no "5" for 5, no true for 1),
their bounds, and their wording (gateway.openai.validation).

`Annotated[Integer, between(1, 16), none_is(1)]` reads: an integer in [1, 16], null meaning 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from annotated_types import Ge, Le
from pydantic import AfterValidator, AllowInfNan, BeforeValidator, Field, Strict

from gateway.openai.validation import Invalid, expect

INT64 = 2**63
MAX_TOKEN_ID = 2**31 - 1  # vocabularies are far smaller; anything above is garbage
SURROGATE = "contains an unpaired UTF-16 surrogate (invalid Unicode)"
T = TypeVar("T")


def check(ok: Callable[[Any], bool], reason: str = "", message: str | None = None) -> Any:
    """A validator that refuses a value `ok` says no to."""

    def run(value: T) -> T:
        if not ok(value):
            raise Invalid(reason, message=message)
        return value

    return AfterValidator(run)


def between(lo: float, hi: float) -> Any:
    return check(lambda v: lo <= v <= hi, f"must be between {lo} and {hi}")


def at_most(limit: int, reason: str) -> Any:
    return check(lambda v: len(v) <= limit, reason)


def at_most_given(kind: type, limit: int, reason: str) -> Any:
    """The length bound checked on the value as given, before its items are (the cheaper check,
    and the one answered first)."""

    def run(value: Any) -> Any:
        if isinstance(value, kind) and len(value) > limit:
            raise Invalid(reason)
        return value

    return BeforeValidator(run)


def of_type(kind: str, reason: str) -> Any:
    """An object of OpenAI's `{"type": kind, ...}` form, refused whole (`reason`) otherwise."""

    def run(value: Any) -> Any:
        if not isinstance(value, dict) or value.get("type") != kind:
            raise Invalid(reason)
        return value

    return BeforeValidator(run)


def none_is(default: Any) -> Any:
    """JSON null means the field's default (clients send null for "not given")."""
    return BeforeValidator(lambda v: default if v is None else v)


def _required(value: Any) -> Any:
    if value is None:
        raise Invalid("is required")
    return value


# With absent_is_null(): absent and null are both refused, as "is required".
REQUIRED = BeforeValidator(_required)


def absent_is_null() -> Any:
    """The default of a field that must be given: absent is validated as null, so the field's
    own wording refuses it (pydantic's "missing" error would bypass it)."""
    return Field(None, validate_default=True)


POSITIVE = check(lambda v: v > 0, "must be greater than 0")
NON_EMPTY = check(len, "must not be empty")


def encodable(value: str) -> bool:
    """JSON's \\uD800-style escapes can smuggle lone surrogates into a str; they cannot be
    encoded (tokenizer, Redis, JSON out), so they are refused up front rather than fail later
    with a 500."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


UNICODE = check(encodable, SURROGATE)

Integer = Annotated[int, Strict(), expect("must be an integer")]
Number = Annotated[float, Strict(), AllowInfNan(False), expect("must be a number")]
Boolean = Annotated[bool, Strict(), expect("must be a boolean")]
Flag = Annotated[Boolean, none_is(False)]  # null or absent: false
String = Annotated[str, Strict(), expect("must be a string")]
Text = Annotated[String, UNICODE]  # a string that goes into the prompt
TokenIds = Annotated[
    list[Annotated[int, Strict(), Ge(0), Le(MAX_TOKEN_ID)]],
    expect(f"must be a list of integers between 0 and {MAX_TOKEN_ID}", nested=True),
]
# No pydantic constraints on strings (MinLen, pattern): they refuse a lone surrogate in their
# own words, before ours can.
NonEmptyText = Annotated[
    str, Strict(), check(len, "must be a non-empty string"), expect("must be a non-empty string")
]


def refuse_unsupported(data: Any, unsupported: dict[str, Any]) -> Any:
    """Known OpenAI fields this server cannot honour: allowed only absent, null or their "off"
    value (refused before anything else is read)."""
    if isinstance(data, dict):
        for name, off in unsupported.items():
            value = data.get(name)
            if value is not None and not (value == off and type(value) is type(off)):
                raise Invalid("is not supported by this server", field=name)
    return data
