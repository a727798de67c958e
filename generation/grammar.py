"""Structured-output grammars: llguidance grammar strings (what `SamplingParams.grammar` carries)
built from what a request asks for, and their validation against a model's tokenizer.

Pure: llguidance only (Rust, no torch, no aiohttp). The gateway builds and validates a grammar
before anything is queued (a bad schema is the client's 400, not a worker's error); the worker
constrains every output token to it.

JSON is compact (no whitespace between tokens, `whitespace_flexible: False`): a free choice of
whitespace lets a small model loop on spaces and newlines until max_tokens. A schema may still
ask for flexible whitespace itself (`"x-guidance": {"whitespace_flexible": true}`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llguidance import LLMatcher, LLTokenizer, grammar_from

MAX_SCHEMA_BYTES = 64 * 1024  # a schema (or regex, Lark grammar, choice list) serialized
MAX_CHOICES = 256  # guided_choice alternatives
COMPACT_JSON: dict[str, Any] = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar that cannot be built: the message says why (never quotes the input)."""


def json_object() -> str:
    """Any JSON object (response_format json_object)."""
    return json_schema({"type": "object"})


def json_schema(schema: dict[str, Any]) -> str:
    text = dumps(schema)
    try:
        return LLMatcher.grammar_from_json_schema(text, defaults=COMPACT_JSON)
    except ValueError:  # e.g. a lone surrogate's escape
        raise GrammarError("is not a valid JSON schema (invalid Unicode)") from None


def dumps(schema: dict[str, Any]) -> str:
    """`schema` as compact JSON, refused when over the size limit or absurdly deep."""
    try:
        # ASCII: a lone surrogate (JSON's "\\ud800") stays an escape llguidance refuses, never
        # a str that cannot cross into Rust.
        text = json.dumps(schema, separators=(",", ":"))
    except RecursionError:
        raise GrammarError("is nested too deeply") from None
    _check_size(text)
    return text


def regex(pattern: str) -> str:
    _check_size(pattern)
    return LLMatcher.grammar_from_regex(pattern)


def lark(grammar: str) -> str:
    """A Lark grammar (llguidance's dialect), or a GBNF one (llama.cpp's), which it converts."""
    _check_size(grammar)
    try:
        return grammar_from("grammar", grammar)
    except ValueError:  # GBNF that does not convert; the converter's message quotes the input
        raise GrammarError("is neither a valid Lark nor a valid GBNF grammar") from None


def choice(options: Sequence[str]) -> str:
    """Exactly one of `options` (non-empty strings)."""
    if not options or len(options) > MAX_CHOICES:
        raise GrammarError(f"must hold 1 to {MAX_CHOICES} strings")
    if not all(isinstance(o, str) and o for o in options):
        raise GrammarError("must hold non-empty strings")
    # JSON string literals are valid Lark string literals (same escapes).
    return lark("start: " + " | ".join(json.dumps(o) for o in options))


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with compact JSON unless it says otherwise, for a `%json` inside a Lark grammar
    (which takes no compiler defaults)."""
    guidance = {**COMPACT_JSON, **schema.get("x-guidance", {})}
    return {**schema, "x-guidance": guidance}


def make_tokenizer(tokenizer_json: str, n_vocab: int, eos_token_ids: Sequence[int]) -> LLTokenizer:
    """The model's tokenizer as llguidance needs it (a few ms for a 50k vocabulary; build it once
    per model, off the event loop)."""
    return LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_token_ids) or None)


def validate(grammar: str, tokenizer: LLTokenizer | None) -> str | None:
    """None if `grammar` compiles (against `tokenizer`, when given), else the error message."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        return (messages[0] if messages else "invalid grammar").strip()
    return None


def _check_size(text: str) -> None:
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: it cannot cross into Rust
        raise GrammarError("contains an unpaired UTF-16 surrogate (invalid Unicode)") from None
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"is larger than {MAX_SCHEMA_BYTES // 1024} KiB")
