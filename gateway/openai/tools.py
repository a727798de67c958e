"""Function calling, request side: the `tools` / `tool_choice` / `parallel_tool_calls` fields
(`ToolFields`), the tools put into the prompt, and the grammar of a forced call.

The output convention is Hermes' (Qwen2.5, SmolLM2, many fine-tunes): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; gateway.openai.tool_parser reads
it back. A chat template that renders `tools` itself gets them (and assistant `tool_calls` with
arguments as objects, as Hugging Face templates expect); for one that does not, the tools are
described in the system message and earlier calls and results are written out as text.

`tool_choice`: "none" (the tools are left out of the prompt, nothing is parsed), "auto" (the
model's text is parsed for calls), "required" (a grammar forces one valid call, or several
unless parallel_tool_calls is false) or a named function (exactly one call, as vLLM: clients
that name a function, such as langchain's bind_tools(tool_choice=name), expect one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    PrivateAttr,
    Strict,
    StrictStr,
    model_validator,
)

from gateway.openai.field_types import (
    SURROGATE,
    Boolean,
    String,
    absent_is_null,
    at_most_given,
    check,
    of_type,
)
from gateway.openai.structured_outputs import Grammar
from gateway.openai.validation import Invalid, expect
from generation import grammar as g

MAX_TOOLS = 128
MAX_NAME_CHARS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (plus ".")
NAME_RULE = f"must be 1 to {MAX_NAME_CHARS} letters, digits, _ . or -"
CHOICE_RULE = 'must be none, auto, required or {"type": "function", "function": {"name": ...}}'
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class ToolConfig:
    tools: tuple[FunctionSpec, ...]
    choice: str  # none | auto | required | function (forced: the named one)
    forced: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> tuple[FunctionSpec, ...]:
        """The tools the model may call: all of them, the named one, or none."""
        if self.choice == "none":
            return ()
        return tuple(t for t in self.tools if self.forced in (None, t.name))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.offered)

    def grammar(self) -> Grammar | None:
        """For required / a named function: the output is one call (required: or several, when
        parallel calls are allowed) whose arguments validate against the tool's parameters."""
        if self.choice not in ("required", "function"):
            return None
        call = {"anyOf": [_call_schema(t) for t in self.offered]}
        one = f'"{_lark_str(CALL_OPEN)}\\n" call_json "\\n{_lark_str(CALL_CLOSE)}"'
        calls = 'call ("\\n" call)*' if self.parallel and self.forced is None else "call"
        lark = f"start: {calls}\ncall: {one}\ncall_json: %json {g.dumps(g.compact_schema(call))}\n"
        param = "tool_choice" if self.forced else "tools"
        try:
            return Grammar(g.lark(lark), param)
        except g.GrammarError as e:
            raise Invalid(str(e), field="tools") from None


def chat_input(
    messages: list[dict[str, Any]], config: ToolConfig | None, template_has_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` argument for apply_chat_template."""
    offered = [t.spec() for t in config.offered] if config else []
    if template_has_tools:
        return [_for_template(m) for m in messages], offered or None
    out = [_as_text(m) for m in messages]
    if offered:
        prompt = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in offered))
        if out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def format_call(name: str, arguments: Any) -> str:
    """One call in the output convention (how earlier calls are written back into a prompt)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


# --- messages -----------------------------------------------------------------------------------


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object when they are JSON (clients send a JSON string)."""
    arguments = call["function"]["arguments"]
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in calls]
    return {**message, "tool_calls": converted}


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that knows no tools: calls and results become text."""
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    calls = message.get("tool_calls")
    rest = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    if not calls:
        return rest
    text = "\n".join(format_call(c["function"]["name"], _arguments(c)) for c in calls)
    content = message["content"]
    return {**rest, "content": f"{content}\n{text}" if content else text}


# --- the fields ---------------------------------------------------------------------------------


def _storable(parameters: dict[str, Any]) -> dict[str, Any]:
    try:
        g.dumps(parameters)  # size, depth and Unicode checked now; compiled when forced
    except g.GrammarError as e:
        raise Invalid(str(e)) from None
    return parameters


def _no_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


class FunctionSpec(BaseModel):
    # re, not pydantic's pattern: the same rule as ever ("$" also matches before a final "\n")
    name: Annotated[str, Strict(), expect(NAME_RULE), check(_NAME.match, NAME_RULE)] = (
        absent_is_null()
    )
    description: String | None = None
    parameters: Annotated[
        dict[str, Any],
        expect("must be a JSON schema object"),
        AfterValidator(_storable),
    ] = Field(default_factory=_no_parameters)

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        try:  # it goes into the prompt: text that cannot be encoded would fail the tokenizer
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise Invalid(SURROGATE) from None
        except (ValueError, RecursionError):  # nested too deeply: refused below
            pass
        if data.get("parameters") is None:  # null: a function that takes no arguments
            data = {**data, "parameters": _no_parameters()}
        return data

    def spec(self) -> dict[str, Any]:
        """OpenAI's (and chat templates') form of the tool."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class FunctionTool(BaseModel):
    function: Annotated[FunctionSpec, expect("must be an object")] = absent_is_null()


class FunctionName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice, expect(CHOICE_RULE, nested=True)
]
Tools = Annotated[
    list[Annotated[FunctionTool, of_type("function", "must be a function tool (type: function)")]],
    expect("must be a list of function tools"),
    at_most_given(list, MAX_TOOLS, f"may hold at most {MAX_TOOLS} tools"),
]


class ToolFields(BaseModel):
    """The function-calling fields of a chat request; `tool_config` is what they ask for (None:
    no tools)."""

    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Boolean | None = None
    _tool_config: ToolConfig | None = PrivateAttr(None)

    @property
    def tool_config(self) -> ToolConfig | None:
        return self._tool_config

    @model_validator(mode="after")
    def _build_config(self) -> ToolFields:
        tools = tuple(t.function for t in self.tools or ())
        if len({t.name for t in tools}) != len(tools):
            raise Invalid("names each function once", field="tools")
        choice, forced = _tool_choice(self.tool_choice, tools)
        if tools:
            self._tool_config = ToolConfig(
                tools, choice, forced, self.parallel_tool_calls is not False
            )
        return self


def _tool_choice(
    value: str | NamedToolChoice | None, tools: tuple[FunctionSpec, ...]
) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value != "none" and not tools:
            raise Invalid("needs 'tools'", field="tool_choice")
        return value, None
    if value.function.name not in {t.name for t in tools}:
        raise Invalid("names a function not in 'tools'", field="tool_choice")
    return "function", value.function.name


# --- the forced call ----------------------------------------------------------------------------


def _call_schema(tool: FunctionSpec) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark_str(text: str) -> str:
    return json.dumps(text)[1:-1]
