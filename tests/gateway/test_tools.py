"""Function calling without HTTP: tools and tool_choice parsed, the prompt rendered (with and
without a template that knows tools), the forced-call grammar, and calls read out of text,
whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llguidance import LLMatcher
from transformers import PreTrainedTokenizerFast

from gateway.openai.errors import ApiError
from gateway.openai.request_models import parse_chat
from gateway.openai.tool_parser import ToolCall, ToolStream, parse_output
from gateway.openai.tools import SYSTEM_PROMPT, ToolConfig, ToolFields, chat_input
from gateway.openai.validation import validate
from generation import grammar as g

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
NAMES = frozenset({"get_weather", "get_time"})
USER = [{"role": "user", "content": "Weather in Paris?"}]


def parse_tools(fields: dict[str, Any]) -> ToolConfig | None:
    """The tool fields of a chat request alone, validated as the request's are."""
    return validate(ToolFields, fields).tool_config


def config(**fields: Any) -> ToolConfig:
    parsed = parse_tools({"tools": [WEATHER, TIME], **fields})
    assert parsed is not None
    return parsed


# --- request fields -----------------------------------------------------------------------------


def test_tool_choice_defaults_and_forms() -> None:
    assert parse_tools({}) is None
    assert parse_tools({"tool_choice": "none"}) is None
    auto = config()
    assert (auto.choice, auto.parallel, auto.names) == ("auto", True, NAMES)
    assert auto.grammar() is None
    assert config(tool_choice="none").offered == ()
    named = config(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.forced, named.names) == ("function", "get_time", {"get_time"})
    assert not config(parallel_tool_calls=False).parallel


BAD_TOOLS: list[tuple[dict[str, Any], str]] = [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
        "tools[0].function.description",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"x": "y" * g.MAX_SCHEMA_BYTES}},
                }
            ]
        },
        "tools[0].function.parameters",
    ),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
        "tools[0].function",
    ),
    ({"tools": [WEATHER] * 200}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS)
def test_bad_tools_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_tools(fields)
    assert e.value.status == 400 and e.value.param == param


BAD_CHATS: list[tuple[dict[str, Any], str]] = [
    ({"tools": [WEATHER], "logprobs": True}, "logprobs"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}]},
        "messages[0].tool_calls[0]",
    ),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages[0].tool_calls"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]},
        "messages[0].tool_calls[0]",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
        "messages[0].tool_calls[0]",
    ),
    (
        {"messages": [{"role": "tool", "content": "1", "tool_call_id": 5}]},
        "messages[0].tool_call_id",
    ),
    ({"tools": [WEATHER], "tool_choice": "required", "n": 0}, "n"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_CHATS)
def test_bad_tool_chats_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": USER, **fields})
    assert e.value.status == 400 and e.value.param == param


# --- the prompt ---------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
]


def test_a_template_without_tools_gets_them_as_text(tokenizer: PreTrainedTokenizerFast) -> None:
    """The tiny ChatML template knows no tools: the tool list joins the system message, the
    earlier call is written in the output convention, the result as a tool response."""
    parsed = parse_chat({"messages": CONVERSATION, "tools": [WEATHER]})
    messages, specs = chat_input(
        parsed.template_messages(), parsed.tool_config, template_has_tools=False
    )
    assert specs is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3]["content"] == "<tool_response>\n22 C, sunny\n</tool_response>"
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")


def test_tools_get_a_system_message_of_their_own() -> None:
    messages, _ = chat_input(USER, config(), template_has_tools=False)
    assert messages[0]["role"] == "system" and messages[1:] == USER
    assert messages[0]["content"].startswith(SYSTEM_PROMPT.split("{tools}")[0])
    assert '"name": "get_time"' in messages[0]["content"]


def test_tool_choice_none_leaves_the_tools_out() -> None:
    messages, specs = chat_input(USER, config(tool_choice="none"), template_has_tools=False)
    assert messages == USER and specs is None


def test_a_template_with_tools_renders_them_itself(tokenizer: PreTrainedTokenizerFast) -> None:
    """A template that uses `tools` gets them, and earlier calls with arguments as objects."""
    template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}\n{% endfor %}"
    )
    parsed = parse_chat({"messages": CONVERSATION, "tools": [WEATHER]})
    messages, specs = chat_input(
        parsed.template_messages(), parsed.tool_config, template_has_tools=True
    )
    assert specs == [WEATHER]
    assert messages[3] == {"role": "tool", "content": "22 C, sunny", "tool_call_id": "call_1"}
    text = tokenizer.apply_chat_template(
        messages, tools=specs, chat_template=template, tokenize=False
    )
    assert text.startswith("TOOL get_weather\n") and "CALL get_weather Paris" in text


# --- the forced call ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lltok(tokenizer: PreTrainedTokenizerFast) -> Any:
    return g.make_tokenizer(
        tokenizer.backend_tokenizer.to_str(), len(tokenizer), [tokenizer.eos_token_id]
    )


def forced_accepts(grammar: str, text: str, lltok: Any, tokenizer: Any) -> bool:
    matcher = LLMatcher(lltok, grammar)
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'


def test_required_forces_valid_calls(lltok: Any, tokenizer: PreTrainedTokenizerFast) -> None:
    grammar = config(tool_choice="required").grammar()
    assert grammar is not None and g.validate(grammar.text, lltok) is None
    ok = [CALL, TIME_CALL, CALL + "\n" + TIME_CALL]
    assert all(forced_accepts(grammar.text, t, lltok, tokenizer) for t in ok)
    bad = [
        "Sure! " + CALL,
        CALL.replace("city", "town"),  # arguments against the schema
        CALL.replace("get_weather", "get_news"),
        CALL.replace('{"name"', '{ "name"'),  # compact JSON only
    ]
    assert not any(forced_accepts(grammar.text, t, lltok, tokenizer) for t in bad)


@pytest.mark.parametrize(
    "parallel", [{}, {"parallel_tool_calls": True}, {"parallel_tool_calls": False}]
)
def test_a_named_function_forces_exactly_one_call(
    parallel: dict[str, bool], lltok: Any, tokenizer: PreTrainedTokenizerFast
) -> None:
    """As vLLM: a named choice is one call whatever parallel_tool_calls says (langchain's
    bind_tools(tool_choice=name) must not get the call twice)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    grammar = config(tool_choice=named, **parallel).grammar()
    assert grammar is not None and grammar.param == "tool_choice"
    assert forced_accepts(grammar.text, CALL, lltok, tokenizer)
    assert not forced_accepts(grammar.text, TIME_CALL, lltok, tokenizer)
    assert not forced_accepts(grammar.text, CALL + "\n" + CALL, lltok, tokenizer)


def test_required_without_parallel_calls_forces_one_call(
    lltok: Any, tokenizer: PreTrainedTokenizerFast
) -> None:
    grammar = config(tool_choice="required", parallel_tool_calls=False).grammar()
    assert grammar is not None and grammar.param == "tools"
    assert forced_accepts(grammar.text, TIME_CALL, lltok, tokenizer)
    assert not forced_accepts(grammar.text, CALL + "\n" + TIME_CALL, lltok, tokenizer)


# --- reading calls back -------------------------------------------------------------------------

ARGS = '{"city": "Paris"}'
PARSES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("Just text.", "Just text.", []),
    (CALL, None, [("get_weather", ARGS)]),
    ("Let me check.\n" + CALL + "\n", "Let me check.", [("get_weather", ARGS)]),
    (CALL + "\n" + TIME_CALL, None, [("get_weather", ARGS), ("get_time", "{}")]),
    ("A " + CALL + " B", "A  B", [("get_weather", ARGS)]),
    ('{"name": "get_time", "parameters": {"tz": "UTC"}}', None, [("get_time", '{"tz": "UTC"}')]),
    (
        '  {"name": "get_weather", "arguments": {"city": "Oslo"}}\n',
        None,
        [("get_weather", '{"city": "Oslo"}')],
    ),
    ('{"name": "unknown", "arguments": {}}', '{"name": "unknown", "arguments": {}}', []),
    ('{"a": 1}', '{"a": 1}', []),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ('x <tool_call>{"name": "get_time"', 'x <tool_call>{"name": "get_time"', []),
    ('<tool_call>{"name": "get_time"}', None, [("get_time", "{}")]),  # unterminated but whole
    ("a <tool_cal", "a <tool_cal", []),  # held back, then released
    (
        "<tool_call>" + '{"name":"get_time","arguments":[1]}</tool_call>',
        "<tool_call>" + '{"name":"get_time","arguments":[1]}</tool_call>',
        [],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), PARSES)
def test_calls_are_read_from_whole_and_streamed_text(
    text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    """The whole output, and the same output fed one character at a time and in uneven pieces:
    the same content and calls."""
    got_content, got_calls = parse_output(text, NAMES)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got_calls)
    for size in (1, 3, 7):
        stream = ToolStream(NAMES)
        parts: list[str | ToolCall] = []
        for i in range(0, len(text), size):
            parts += stream.feed(text[i : i + size])
        parts += stream.finish()
        streamed = "".join(p for p in parts if isinstance(p, str))
        assert streamed == (content or "")
        assert [(c.name, c.arguments) for c in parts if isinstance(c, ToolCall)] == calls


def test_text_that_may_start_a_call_is_held_back() -> None:
    stream = ToolStream(NAMES)
    assert stream.feed("Hi <tool") == ["Hi"]  # the space waits for what follows, "<tool" too
    assert stream.feed("box>") == [" <toolbox>"]
