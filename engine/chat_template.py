"""Chat templates: vLLM's `--chat-template` flag, whether a model has one (read cheaply, before
it loads), and the fallback a loaded tokenizer gets.

Light on purpose (jinja2 and the GGUF header reader, no torch): `jitney generate` asks whether
a model can render a chat before it imports torch and loads the model, so a base model without a
template is refused in a moment with what to do instead (`--raw` or `--chat-template FILE`).

The flag takes what vLLM's does: a file holding a Jinja template, or the template itself inline
(a value with `{`, `}` or a newline in it; escapes such as `\\n` are decoded). Either is compiled
here, so a template with a syntax error is refused by the flag, with its line, not later at the
first chat.
"""

from __future__ import annotations

import codecs
import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger("jitney.engine.model")

FLAG = "--chat-template"
CHATML_START = "<|im_start|>"
# Plain ChatML (SmolLM2's template without its default system prompt): what a model whose
# vocabulary has ChatML's tokens gets when it ships no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_INLINE_MARKS = ("{", "}", "\n")


def resolve_chat_template(value: str) -> str:
    """`--chat-template`'s value as the template text: the file it names, else the value itself
    where it looks like a template (vLLM's rule). ValueError, saying why, for an unreadable
    file, a path that does not exist, or a template that does not compile."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{FLAG} {value}: cannot read it as UTF-8 text ({e})") from None
        origin = str(path)
    elif any(mark in value for mark in _INLINE_MARKS):
        text, origin = codecs.decode(value, "unicode_escape"), "the inline template"
    else:
        raise ValueError(
            f"{FLAG} {value}: no such file (a template given inline must contain Jinja's {{ and }})"
        )
    check_chat_template(text, origin)
    return text


def check_chat_template(text: str, origin: str) -> None:
    """ValueError where `text` is empty or not a template Jinja compiles."""
    if not text.strip():
        raise ValueError(f"{FLAG}: {origin} is empty")
    try:
        _ENVIRONMENT.parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(
            f"{FLAG}: {origin} is not a valid Jinja template: {e.message} (line {e.lineno})"
        ) from None


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (marks assistant text): parsed as
    its body, so templates that use it compile here as they do there."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# As transformers compiles chat templates (sandboxed, trim/lstrip blocks, loop controls).
_ENVIRONMENT = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
)


def has_chat_template(spec: str) -> bool | None:
    """Whether the model `spec` names renders chats, read from its files without loading it:
    a .gguf file's `tokenizer.chat_template`, a Hugging Face directory's template files, or
    ChatML's tokens in the vocabulary (ensure_chat_template then gives it ChatML). None where
    this cannot tell (a built-in model: each has a template; a spec the loader will refuse)."""
    path = Path(spec).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return _gguf_has_template(path)
        if (path / "config.json").is_file():
            return _directory_has_template(path)
    except (OSError, ValueError):  # unreadable: the loader says so, in its own words
        return None
    return None


def _gguf_has_template(path: Path) -> bool:
    import struct

    from engine.models.gguf_index import read_gguf_metadata

    try:
        header = read_gguf_metadata(path)
        if header.metadata.get("tokenizer.chat_template"):
            return True
        tokens = read_gguf_metadata(path, ("tokenizer.ggml.tokens",)).arrays
    except struct.error:  # a cut header
        raise ValueError(f"{path}: truncated GGUF header") from None
    return CHATML_START in tokens.get("tokenizer.ggml.tokens", ())


def _directory_has_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file():
        return True
    for name in ("tokenizer_config.json", "chat_template.json"):
        if (path / name).is_file() and json.loads((path / name).read_text()).get("chat_template"):
            return True
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        return False
    data = json.loads(tokenizer.read_text())
    added = {t.get("content") for t in data.get("added_tokens", [])}
    return CHATML_START in added or CHATML_START in data.get("model", {}).get("vocab", {})


def ensure_chat_template(tokenizer: Any, source: Path, fallback: str | None) -> None:
    """A loaded tokenizer without a template gets `fallback`, or ChatML where its vocabulary
    has ChatML's tokens (the tokens say ChatML even if the template was not shipped)."""
    if tokenizer.chat_template:
        return
    if fallback is None and _has_token(tokenizer, CHATML_START):
        fallback = CHATML_TEMPLATE
    if fallback is None:
        logger.warning("%s has no chat template; only plain completions will work", source)
        return
    logger.info("%s has no chat template; using ChatML", source)
    tokenizer.chat_template = fallback


def _has_token(tokenizer: Any, token: str) -> bool:
    """Whether the vocabulary holds `token`, asked of the fast backend where there is one
    (get_vocab builds a dict of the whole vocabulary: 0.2 s for Gemma's 262,144 tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.token_to_id(token) is not None
    return token in tokenizer.get_vocab()
