"""Chat messages: role + content (text parts joined), a tool result's tool_call_id, an
assistant's earlier tool_calls and reasoning; as the chat template gets them (`template_dict`).
And `chat_template_kwargs`, the client's own arguments to the template."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from annotated_types import MinLen
from pydantic import AfterValidator, BaseModel, BeforeValidator, StrictStr, model_validator

from gateway.openai.field_types import (
    SURROGATE,
    String,
    Text,
    absent_is_null,
    encodable,
    none_is,
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
PREDICTION_SHAPE = 'must be {"type": "content", "content": a string or a list of text parts}'


class PredictedOutput(BaseModel):
    """OpenAI's `prediction` (Predicted Outputs): text the reply is expected to repeat, mostly;
    with speculation on, the worker drafts from it first (scheduler/speculation/prediction.py)."""

    content: Content = absent_is_null()

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content)


Prediction = Annotated[
    PredictedOutput, of_type("content", PREDICTION_SHAPE), expect(PREDICTION_SHAPE)
]
ToolCalls = Annotated[
    list[Annotated[AssistantToolCall, expect(CALL_SHAPE, nested=True)]],
    expect("must be a list of tool calls"),
]
# The fields a role's message may carry besides role, content and name (others' are not read).
# An assistant's reasoning comes back as `reasoning_content` (or vLLM's newer `reasoning`).
_ROLE_FIELDS = {
    "tool": ("tool_call_id",),
    "assistant": ("tool_calls", "reasoning_content", "reasoning"),
}
_OWN_FIELDS = frozenset(name for names in _ROLE_FIELDS.values() for name in names)


class ChatMessage(BaseModel):
    role: Annotated[Role, expect(f"must be one of {', '.join(ROLES)}")] = absent_is_null()
    content: Content = absent_is_null()
    name: Text | None = None
    tool_call_id: Text | None = None
    tool_calls: ToolCalls | None = None
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _for_role(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        role = data.get("role")
        own = _ROLE_FIELDS.get(role, ()) if isinstance(role, str) else ()
        data = {k: v for k, v in data.items() if k in own or k not in _OWN_FIELDS}
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
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:  # as Qwen3's and DeepSeek's templates read it
            out["reasoning_content"] = reasoning
        return out


Messages = Annotated[
    list[Annotated[ChatMessage, expect("must be an object")]],
    MinLen(1),
    expect("must be a non-empty list"),
]


# --- chat_template_kwargs -------------------------------------------------------------------

# apply_chat_template's and the template render's own arguments: a kwarg of the same name
# would collide with them (a TypeError naming the client's key).
RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "documents",
        "messages",
        "return_dict",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
    }
)


def _template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    if not RESERVED_TEMPLATE_ARGS.isdisjoint(kwargs):
        raise Invalid("may not set the template's own arguments (messages, tools, ...)")
    try:  # rendered into the prompt: text that cannot be encoded would fail the tokenizer
        json.dumps(kwargs, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise Invalid(SURROGATE) from None
    except RecursionError:
        raise Invalid("is nested too deeply") from None
    return kwargs


# The client's arguments to the chat template (`enable_thinking`, `thinking`, ...), as vLLM
# takes them; null or absent: none.
TemplateKwargs = Annotated[
    dict[str, Any],
    expect("must be an object"),
    AfterValidator(_template_kwargs),
    none_is({}),
]
