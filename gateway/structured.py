"""Structured outputs: the request fields that constrain the output to a grammar.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's extensions, under
both of vLLM's spellings: the `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` fields, and their newer `structured_outputs` object (`json`, `regex`,
`choice`, `grammar`, `json_object`). At most one may be given. The grammar string is built here
(protocol.grammar); it is compiled against the model's tokenizer in gateway.generate, where a
grammar that does not compile is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from protocol import grammar as g

MAX_ERROR_CHARS = 200
_QUOTED = re.compile(r'"[^"]*"|\'[^\']*\'')


@dataclass(frozen=True, slots=True)
class Grammar:
    text: str  # the llguidance grammar (SamplingParams.grammar)
    param: str  # the request field it came from, for a 400 when it does not compile


def parse_grammar(body: dict[str, Any]) -> Grammar | None:
    """The grammar the body asks for, if any; a 400 naming the field when it is malformed."""
    found = [(name, body[name]) for name in _FIELDS if body.get(name) is not None]
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise bad_request("'structured_outputs' must be an object.", "structured_outputs")
        given = {k: v for k, v in outputs.items() if v is not None and v is not False}
        if given.keys() - _NEW_NAMES.keys():  # e.g. structural_tag: refused, not dropped
            raise bad_request(
                "'structured_outputs' holds a field this server does not support; supported: "
                + ", ".join(_NEW_NAMES)
                + ".",
                param="structured_outputs",
            )
        found += [(f"structured_outputs.{key}", value) for key, value in given.items()]
    if found and found[0][0] == "response_format" and _is_text(found[0][1]):
        found = found[1:]  # plain text: no grammar
    if len(found) > 1:
        raise bad_request(
            f"'{found[1][0]}' cannot be combined with '{found[0][0]}': give one output format.",
            param=found[1][0],
        )
    if not found:
        return None
    [(param, value)] = found
    try:
        return Grammar(_build(param, value), param)
    except g.GrammarError as e:
        raise bad_request(f"'{param}' {e}.", param=param) from None


def compile_error(grammar: Grammar, error: str) -> Exception:
    """The 400 for a grammar llguidance would not compile: the first line of its message,
    bounded, with what it quotes of the input left out (errors do not echo input)."""
    lines = error.splitlines() or ["invalid"]
    # The first line, and the regex parser's own "error: ..." line (the others quote the input).
    lines = [lines[0], *(line for line in lines[1:] if line.startswith("error:"))]
    reason = _QUOTED.sub('"..."', " ".join(lines))
    return bad_request(
        f"'{grammar.param}' is not a valid grammar: {reason[:MAX_ERROR_CHARS]}", grammar.param
    )


_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# vLLM's newer spelling: structured_outputs.<key> means the same as the older field
_NEW_NAMES = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "json_object": "json_object",
}


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _build(param: str, value: Any) -> str:
    kind = _NEW_NAMES.get(param.removeprefix("structured_outputs."), param)
    if kind == "response_format":
        return _response_format(value)
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"'{param}' must be true.", param=param)
        return g.json_object()
    if kind == "guided_json":
        return g.json_schema(_schema(value, param, allow_string=True))
    if kind == "guided_choice":
        if not isinstance(value, list):
            raise bad_request(f"'{param}' must be a list of strings.", param=param)
        return g.choice(value)
    # guided_regex, guided_grammar
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string.", param=param)
    return g.regex(value) if kind == "guided_regex" else g.lark(value)


def _response_format(value: Any) -> str:
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return g.json_object()
    if kind != "json_schema":
        raise bad_request(
            "'response_format.type' must be one of text, json_object, json_schema.",
            param="response_format.type" if isinstance(value, dict) else param,
        )
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"'{param}' must be an object.", param=param)
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"'{param}.name' must be a string.", param=f"{param}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):  # always enforced: a grammar
        raise bad_request(f"'{param}.strict' must be a boolean.", param=f"{param}.strict")
    return g.json_schema(_schema(spec.get("schema"), f"{param}.schema"))


def _schema(value: Any, param: str, allow_string: bool = False) -> dict[str, Any]:
    if allow_string and isinstance(value, str):  # vLLM takes guided_json as a JSON string too
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise bad_request(f"'{param}' is not valid JSON.", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be a JSON schema object.", param=param)
    return value
