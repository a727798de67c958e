"""Function calling, request side: `tools` and `tool_choice` parsed, put into the prompt, and
turned into a grammar when a call is forced.

The output convention is Hermes' (Qwen2.5, SmolLM2, many fine-tunes): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; gateway.tool_parser reads it
back. A chat template that renders `tools` itself gets them (and assistant `tool_calls` with
arguments as objects, as Hugging Face templates expect); for one that does not, the tools are
described in the system message and earlier calls and results are written out as text.

`tool_choice`: "none" (the tools are left out of the prompt, nothing is parsed), "auto" (the
model's text is parsed for calls), "required" or a named function (a grammar forces one valid
call, or several with parallel_tool_calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from gateway.structured import Grammar
from protocol import grammar as g

MAX_TOOLS = 128
MAX_NAME_CHARS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (plus ".")
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
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        """OpenAI's (and chat templates') form of the tool."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolConfig:
    tools: tuple[Tool, ...]
    choice: str  # none | auto | required | function (forced: the named one)
    forced: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model may call: all of them, the named one, or none."""
        if self.choice == "none":
            return ()
        return tuple(t for t in self.tools if self.forced in (None, t.name))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.offered)

    def grammar(self) -> Grammar | None:
        """For required / a named function: the output is one call (or several, when parallel
        calls are allowed) whose arguments validate against the tool's parameters."""
        if self.choice not in ("required", "function"):
            return None
        call = {"anyOf": [_call_schema(t) for t in self.offered]}
        one = f'"{_lark_str(CALL_OPEN)}\\n" call_json "\\n{_lark_str(CALL_CLOSE)}"'
        calls = 'call ("\\n" call)*' if self.parallel else "call"
        lark = f"start: {calls}\ncall: {one}\ncall_json: %json {g.dumps(g.compact_schema(call))}\n"
        param = "tool_choice" if self.forced else "tools"
        try:
            return Grammar(g.lark(lark), param)
        except g.GrammarError as e:
            raise bad_request(f"'tools' {e}.", param="tools") from None


def parse_tools(body: dict[str, Any]) -> ToolConfig | None:
    tools = _tools(body.get("tools"))
    choice, forced = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    if not tools:
        return None
    return ToolConfig(tools, choice, forced, parallel is not False)


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


# --- fields -------------------------------------------------------------------------------------


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list of function tools.", param="tools")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} tools.", param="tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(value))
    if len({t.name for t in tools}) != len(tools):
        raise bad_request("'tools' names each function once.", param="tools")
    return tools


def _tool(value: Any, param: str) -> Tool:
    if not isinstance(value, dict) or value.get("type") != "function":
        raise bad_request(f"'{param}' must be a function tool (type: function).", param=param)
    function = value.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"'{param}.function' must be an object.", param=f"{param}.function")
    try:  # it goes into the prompt: text that cannot be encoded would fail the tokenizer
        json.dumps(function, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            f"'{param}.function' contains an unpaired UTF-16 surrogate (invalid Unicode).",
            param=f"{param}.function",
        ) from None
    except (ValueError, RecursionError):  # nested too deeply: refused below
        pass
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(
            f"'{param}.function.name' must be 1 to {MAX_NAME_CHARS} letters, digits, _ . or -.",
            param=f"{param}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(
            f"'{param}.function.description' must be a string.", f"{param}.function.description"
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(
            f"'{param}.function.parameters' must be a JSON schema object.",
            param=f"{param}.function.parameters",
        )
    try:
        g.dumps(parameters)  # size, depth and Unicode checked now; compiled when forced
    except g.GrammarError as e:
        raise bad_request(
            f"'{param}.function.parameters' {e}.", f"{param}.function.parameters"
        ) from None
    return Tool(name, description, parameters)


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise bad_request("'tool_choice' needs 'tools'.", param="tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            "'tool_choice' must be none, auto, required or "
            '{"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    if name not in {t.name for t in tools}:
        raise bad_request("'tool_choice' names a function not in 'tools'.", param="tool_choice")
    return "function", name


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark_str(text: str) -> str:
    return json.dumps(text)[1:-1]
