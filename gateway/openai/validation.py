"""A request body validated against its pydantic model in one pass, or the OpenAI 400 naming the
field (`param`, nested as `messages[0].content`).

The messages are ours, never pydantic's (which quote the input): an error must not echo input.
Validators raise `Invalid`; `expect` turns pydantic's own errors at a field (a wrong type, a
missing value) into an `Invalid` with the field's wording. The first error, in the model's field
order, is the one answered. Any other exception in a validator is a bug and stays one (a 500).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import ErrorDetails

from gateway.openai.errors import ApiError, bad_request

M = TypeVar("M", bound=BaseModel)


class Invalid(ValueError):
    """What is wrong with a value: `reason` completes "'<param>' ..." (or `message` is the whole
    message). `field` names a field below the value's own location (a check of the whole model
    that blames one of its fields)."""

    def __init__(self, reason: str = "", field: str = "", message: str | None = None):
        super().__init__(reason or message)
        self.reason = reason
        self.field = field
        self.message = message


def expect(reason: str, nested: bool = False) -> WrapValidator:
    """A field's wording for pydantic's own errors at it (`nested`: below it too, and every
    error below is then reported at the field itself, as one value)."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            first = e.errors(include_url=False, include_input=False)[0]
            below = bool(first["loc"])
            if _bug(first) is not None or (below and not nested):
                raise  # a bug, or a field below that words its own errors
            cause = _cause(first)
            if cause is None:
                raise Invalid(reason) from None
            if below:  # nested: one of ours from below, said of the field itself
                raise Invalid(cause.reason, cause.field, cause.message) from None
            raise

    return WrapValidator(check)


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise api_error(e.errors(include_url=False, include_input=False)[0]) from None


def api_error(error: ErrorDetails) -> ApiError:
    if (bug := _bug(error)) is not None:
        raise bug
    # None: a pydantic error that no `expect` words (a gap in a model; still the input's fault)
    cause = _cause(error) or Invalid("is invalid")
    param = ".".join(p for p in (_param(error["loc"]), cause.field) if p)
    return bad_request(cause.message or f"'{param}' {cause.reason}.", param=param)


def _cause(error: ErrorDetails) -> Invalid | None:
    cause = error.get("ctx", {}).get("error")
    return cause if isinstance(cause, Invalid) else None


def _bug(error: ErrorDetails) -> Exception | None:
    """A ValueError (or a failed assert) raised by a validator that is not an `Invalid`."""
    cause = error.get("ctx", {}).get("error")
    return cause if isinstance(cause, Exception) and not isinstance(cause, Invalid) else None


def _param(loc: tuple[int | str, ...]) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (strict UTF-8, no NaN or Infinity), or a 400."""

    def no_constants(name: str) -> Any:
        raise ValueError("NaN and Infinity are not valid JSON")

    try:
        # Strict UTF-8 (RFC 8259), not json's guess among UTF-8/16/32.
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8.", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError):  # JSONDecodeError, and ints over 4300 digits
        raise bad_request("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body
