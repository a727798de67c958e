"""The Responses API's input items: messages (text only), function calls and their outputs,
reasoning, as one model (`InputItem`) so that an error names the field as `input[2].call_id`. A
response's own output items are valid input, as clients send them back; a stored conversation
is kept as `InputItem.stored()` dicts and read back by the same rules (`STORED_ITEMS`). A
reasoning item's text is its `content` (`reasoning_text` parts); its `summary` is not read (this
server writes none), and `encrypted_content`, which only its maker can read, is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import MinLen
from pydantic import AfterValidator, BaseModel, BeforeValidator, TypeAdapter, model_validator

from gateway.openai.field_types import (
    SURROGATE,
    String,
    Text,
    absent_is_null,
    at_most,
    check,
    encodable,
)
from gateway.openai.validation import Invalid, expect

MAX_ID_CHARS = 256  # a call id (or the request's user, cache key): bounded, it is stored and echoed


TEXT_PARTS = ("input_text", "output_text")  # a message's; a reasoning item's are reasoning_text


def _text_part(value: Any) -> Any:
    if not isinstance(value, dict) or value.get("type") not in (*TEXT_PARTS, "reasoning_text"):
        raise Invalid("must be a text part (input_text or output_text); only text is supported")
    return value


class TextPart(BaseModel):
    type: str  # checked against its item's type (InputItem)
    text: String = absent_is_null()


def _as_parts(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def _encodable_text(parts: list[TextPart]) -> list[TextPart]:
    if not encodable("".join(p.text for p in parts)):
        raise Invalid(SURROGATE)
    return parts


Content = Annotated[
    list[Annotated[TextPart, BeforeValidator(_text_part)]],
    expect("must be a string or a list of text parts"),
    AfterValidator(_encodable_text),
    BeforeValidator(_as_parts),
]
CallId = Annotated[
    Text, check(len, "must be a non-empty string"), at_most(MAX_ID_CHARS, "is too long")
]
Role = Literal["user", "system", "developer", "assistant"]
# The fields each item type must have (a message may leave its type out: the API's easy form);
# fields of other types are not read.
ITEM_FIELDS = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
    "reasoning": (),
}


class InputItem(BaseModel):
    """A message (text only), a function call, or a call's output: one model, so an error names
    the field as `input[2].call_id`."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"]
    role: Annotated[Role, expect("must be one of user, system, developer, assistant")] | None = None
    content: Content | None = None
    call_id: CallId | None = None
    name: Text | None = None
    arguments: Text | None = None  # a JSON string, as the API sends it
    output: Content | None = None

    @model_validator(mode="before")
    @classmethod
    def _of_its_type(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # refused as "must be an object"
        kind = data.get("type", "message")
        if kind not in ITEM_FIELDS:
            supported = ", ".join(ITEM_FIELDS)
            raise Invalid(f"is not supported by this server; supported: {supported}", "type")
        for name in ITEM_FIELDS[kind]:
            if data.get(name) is None:
                raise Invalid("is required", field=name)
        fields = {name: data[name] for name in ITEM_FIELDS[kind]}
        if kind == "reasoning":
            if data.get("encrypted_content") is not None:
                raise Invalid("cannot be read by this server", field="encrypted_content")
            fields["content"] = data.get("content") or []
        return {"type": kind, **fields}

    @model_validator(mode="after")
    def _parts_of_its_type(self) -> InputItem:
        """A reasoning item holds reasoning_text parts; a message, input or output text."""
        want = ("reasoning_text",) if self.type == "reasoning" else TEXT_PARTS
        if any(part.type not in want for part in self.content or []):
            raise Invalid(f"must hold {' or '.join(want)} parts", field="content")
        return self

    @property
    def text(self) -> str:
        """A message's content, or a call's output, as one string."""
        return "".join(p.text for p in self.content or self.output or [])

    def stored(self) -> dict[str, Any]:
        """The item as a stored conversation keeps it (read back by these same rules)."""
        out = self.model_dump(exclude_none=True, exclude={"content", "output"})
        if self.type == "message":
            part = "output_text" if self.role == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": self.text}]
        elif self.type == "reasoning":
            out["content"] = [{"type": "reasoning_text", "text": self.text}]
        elif self.type == "function_call_output":
            out["output"] = self.text
        return out


def _text_input(value: Any) -> Any:
    """A string is one user message."""
    if not isinstance(value, str):
        return value
    if not value:
        raise Invalid("must not be empty")
    if not encodable(value):
        raise Invalid(SURROGATE)
    return [{"type": "message", "role": "user", "content": value}]


Items = Annotated[
    list[Annotated[InputItem, expect("must be an object")]],
    MinLen(1),
    expect("must be a non-empty string or a non-empty list of input items"),
    BeforeValidator(_text_input),
]
STORED_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(Items)
