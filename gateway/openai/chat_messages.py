"""Chat messages: role + content (text parts joined), a tool result's tool_call_id, an
assistant's earlier tool_calls; as the chat template gets them (`template_dict`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import MinLen
from pydantic import AfterValidator, BaseModel, BeforeValidator, StrictStr, model_validator

from gateway.openai.field_types import (
    SURROGATE,
    String,
    Text,
    absent_is_null,
    encodable,
    of_type,
)
from gateway.openai.validation import Invalid, expect

ROLES = ("assistant", "developer", "system", "tool", "user")
Role = Literal["assistant", "developer", "system", "tool", "user"]
CALL_SHAPE = "must be {id, type: function, function: {name, arguments}} with string values"


class TextPart(BaseModel):
    text: String = absent_is_null()


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr  # a JSON string, as OpenAI sends it


class AssistantToolCall(BaseModel):
    """An assistant's earlier call, in OpenAI's shape (its `type` is not read)."""

    id: StrictStr = ""
    function: FunctionCall

    @model_validator(mode="after")
    def _encodable(self) -> AssistantToolCall:
        if not (encodable(self.function.name) and encodable(self.function.arguments)):
            raise Invalid(SURROGATE, field="function")
        if not encodable(self.id):
            raise Invalid(SURROGATE, field="id")
        return self

    def template_dict(self) -> dict[str, Any]:
        function = {"name": self.function.name, "arguments": self.function.arguments}
        return {"id": self.id, "type": "function", "function": function}


def _as_parts(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _encodable_text(parts: list[TextPart]) -> list[TextPart]:
    if not encodable("".join(p.text for p in parts)):  # the content, joined, is what is encoded
        raise Invalid(SURROGATE)
    return parts


Content = Annotated[
    list[Annotated[TextPart, of_type("text", "must be a text part; only text is supported")]],
    expect("must be a string or a list of text parts"),
    AfterValidator(_encodable_text),
    BeforeValidator(_as_parts),
]
ToolCalls = Annotated[
    list[Annotated[AssistantToolCall, expect(CALL_SHAPE, nested=True)]],
    expect("must be a list of tool calls"),
]
# The fields a role's message may carry besides role, content and name (others' are not read).
_ROLE_FIELDS = {"tool": "tool_call_id", "assistant": "tool_calls"}


class ChatMessage(BaseModel):
    role: Annotated[Role, expect(f"must be one of {', '.join(ROLES)}")] = absent_is_null()
    content: Content = absent_is_null()
    name: Text | None = None
    tool_call_id: Text | None = None
    tool_calls: ToolCalls | None = None

    @model_validator(mode="before")
    @classmethod
    def _for_role(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        role = data.get("role")
        own = _ROLE_FIELDS.get(role) if isinstance(role, str) else None
        data = {k: v for k, v in data.items() if k == own or k not in _ROLE_FIELDS.values()}
        if role == "assistant" and data.get("content") is None:
            data["content"] = ""  # a reply that was only tool calls
        return data

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as apply_chat_template takes it (and gateway.openai.tools reads)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        for key in ("name", "tool_call_id"):
            if (value := getattr(self, key)) is not None:
                out[key] = value
        if self.tool_calls is not None:
            out["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        return out


Messages = Annotated[
    list[Annotated[ChatMessage, expect("must be an object")]],
    MinLen(1),
    expect("must be a non-empty list"),
]
