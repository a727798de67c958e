"""Reasoning outputs: a reasoning model's text split into its reasoning and its answer (content),
incrementally, as vLLM's `--reasoning-parser` does.

A format is a family's markers: `<think>`...`</think>` (DeepSeek-R1, Qwen3, QwQ) or Granite's
"Here is my thought process:"...."Here is my response:". Where an output starts is read from the
end of its prompt first: a template that already opened the reasoning (`<think>\n`, DeepSeek-R1's
and Qwen3.5's) starts it inside; one that already closed it (Qwen3's `enable_thinking: false`
writes `<think>\n\n</think>\n\n`) starts it in the answer. Otherwise the output itself says: a
start marker at its beginning (after whitespace) opens the reasoning; without one the output is
all content, except in `deepseek_r1`, whose early models write no start marker (their output is
reasoning until the end marker). Reasoning ends at the first end marker; an output that never
writes one is all reasoning. Only the markers at those places are markers; any other occurrence
is text.

Whitespace around the markers is dropped: the reasoning is stripped, and the content after it
loses its leading whitespace (an output with no reasoning keeps its content as written).

Streaming gives the same result as the whole text (`split` is the stream fed once): text that
may be the start of a marker, or whitespace that may turn out to be next to one, is held back
until the next text decides, as the detokenizer holds back an incomplete character. Markers are
matched in the text, so they must decode as text, not be special tokens the detokenizer drops
(in Qwen3's and the DeepSeek-R1 distills' tokenizers `<think>` is an added token not marked
special).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class Phase(enum.Enum):
    OPENING = "opening"  # a start marker may still come (whitespace and its prefix held)
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    starts: tuple[str, ...]  # markers that open the reasoning (any one)
    ends: tuple[str, ...]  # markers that close it
    # An output that does not open with a start marker is reasoning all the same (DeepSeek-R1).
    implicit_start: bool = False

    def phase_after(self, prompt: str) -> Phase:
        """Where an output after `prompt` (its rendered end) starts."""
        tail = prompt.rstrip()
        if tail.endswith(self.ends):
            return Phase.CONTENT
        if tail.endswith(self.starts):
            return Phase.REASONING
        return Phase.OPENING


THINK = ReasoningFormat("qwen3", ("<think>",), ("</think>",))
FORMATS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat("deepseek_r1", THINK.starts, THINK.ends, implicit_start=True),
        THINK,
        ReasoningFormat(
            "granite",
            ("Here is my thought process:", "Here's my thought process:"),
            ("Here is my response:", "Here's my response:"),
        ),
    )
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The format called `name`, or a ValueError listing the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(FORMATS))
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})") from None


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = max(map(len, markers)) - 1
    for n in range(min(longest, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


@dataclass(slots=True)
class ReasoningStream:
    """Feed a choice's text deltas, get (reasoning, content) deltas; `finish` at its end.

    Also counts the output's reasoning tokens, as the caller says how many tokens each delta
    came from: a token counts as reasoning when its text arrived while the reasoning was open
    (the end marker's own tokens included), or before a start marker that opened it."""

    format: ReasoningFormat
    phase: Phase = Phase.OPENING
    num_reasoning_tokens: int = 0
    _held: str = ""  # text not yet emitted: a possible marker, or whitespace next to one
    _opened: bool = False  # the reasoning was opened (by the prompt or the output)
    _reasoned: bool = False  # reasoning text was emitted (its leading whitespace is gone)
    _content_strip: bool = False  # content after reasoning: its leading whitespace is dropped
    _opening_tokens: int = 0  # tokens seen while OPENING: reasoning if a start marker follows

    @classmethod
    def after_prompt(cls, format: ReasoningFormat, prompt: str) -> ReasoningStream:
        stream = cls(format)
        phase = format.phase_after(prompt)
        if phase is Phase.REASONING:
            stream._open_reasoning()
        stream.phase = phase
        return stream

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        before = self.phase
        reasoning, content = self._advance(self._held + text, final=False)
        if before is Phase.REASONING:
            self.num_reasoning_tokens += num_tokens
        elif before is Phase.OPENING:
            self._opening_tokens += num_tokens
            if self.phase is not Phase.OPENING and self._opened:
                self.num_reasoning_tokens += self._opening_tokens
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The output ended: what is still held goes where it belongs."""
        return self._advance(self._held, final=True)

    def _advance(self, text: str, final: bool) -> tuple[str, str]:
        self._held = ""
        reasoning = ""
        if self.phase is Phase.OPENING:
            text = self._open(text, final)
            if self.phase is Phase.OPENING:
                return "", ""
        if self.phase is Phase.REASONING:
            reasoning, text = self._reason(text, final)
            if self.phase is Phase.REASONING:
                return reasoning, ""
        return reasoning, self._content(text)

    def _open(self, text: str, final: bool) -> str:
        """OPENING: a start marker after whitespace opens the reasoning; anything else decides
        the format's default. Returns the text the decided phase takes."""
        stripped = text.lstrip()
        for marker in self.format.starts:
            if stripped.startswith(marker):
                self._open_reasoning()
                return stripped[len(marker) :]
        if not final and any(m.startswith(stripped) for m in self.format.starts):
            self._held = text  # whitespace, or the start of a marker: the next text decides
            return ""
        if self.format.implicit_start:
            self._open_reasoning()
        else:
            self.phase = Phase.CONTENT  # no reasoning: the content as written
        return text

    def _open_reasoning(self) -> None:
        self.phase = Phase.REASONING
        self._opened = self._content_strip = True

    def _reason(self, text: str, final: bool) -> tuple[str, str]:
        """REASONING: the reasoning up to the first end marker (stripped), and the text after
        it. Held: a possible end marker's start and the whitespace before it."""
        hits = [(i, m) for m in self.format.ends if (i := text.find(m)) != -1]
        if hits:
            end, marker = min(hits)
            self.phase = Phase.CONTENT
            return self._reasoning_text(text[:end].rstrip()), text[end + len(marker) :]
        if final:
            return self._reasoning_text(text.rstrip()), ""
        keep = len(text) - partial_suffix(text, self.format.ends)
        body = text[:keep].rstrip()
        self._held = text[len(body) :]
        return self._reasoning_text(body), ""

    def _reasoning_text(self, text: str) -> str:
        if not self._reasoned:
            text = text.lstrip()
            self._reasoned = bool(text)
        return text

    def _content(self, text: str) -> str:
        if self._content_strip:
            text = text.lstrip()
            self._content_strip = not text  # whitespace so far: still dropped
        return text


def split(format: ReasoningFormat, text: str, prompt: str = "") -> tuple[str, str]:
    """A whole output's (reasoning, content), as its stream would give them."""
    stream = ReasoningStream.after_prompt(format, prompt)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return reasoning + more_reasoning, content + more_content


# --- structured outputs: the grammar holds for the content only -------------------------------

CONTENT_GRAMMAR = "jitney_content"  # the request's grammar, as a sub-grammar of the wrapper
_SPACE = r"[ \t\r\n]"
_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$#&-~/")


def _alternatives(markers: tuple[str, ...]) -> str:
    """The markers as one regex group (a Lark `/.../` body: `/` escaped too)."""
    escaped = ("".join("\\" + c if c in _REGEX_SPECIAL else c for c in m) for m in markers)
    return "(" + "|".join(escaped) + ")"


def content_grammar(format: ReasoningFormat, phase: Phase, grammar: str) -> str:
    """`grammar` (llguidance's: a TopLevelGrammar's JSON, or Lark text) made to hold for the
    content only: the reasoning before it is free text up to the first end marker, where the
    stream splits it (vLLM lets the grammar start at the end of the reasoning alike)."""
    if phase is Phase.CONTENT:
        return grammar
    body, ends, starts = "(?s:.*)", _alternatives(format.ends), _alternatives(format.starts)
    if phase is Phase.REASONING:  # the prompt opened it
        head, reasoning = "reasoning SPACE?", f"{body}{ends}"
    elif format.implicit_start:
        head, reasoning = "reasoning SPACE?", f"{_SPACE}*{starts}?{body}{ends}"
    else:  # reasoning only when the output opens it
        head, reasoning = "(reasoning SPACE?)?", f"{_SPACE}*{starts}{body}{ends}"
    lark = (
        f"start: {head} @{CONTENT_GRAMMAR}\n"
        f"reasoning[lazy]: /{reasoning}/\n"  # lazy: it ends at the first end marker
        f"SPACE: /{_SPACE}+/\n"
    )
    if grammar.lstrip().startswith("{"):
        top = json.loads(grammar)
    else:  # Lark text
        top = {"grammars": [{"lark_grammar": grammar}]}
    first, *rest = top["grammars"]
    grammars = [{"lark_grammar": lark}, {**first, "name": CONTENT_GRAMMAR}, *rest]
    return json.dumps({**top, "grammars": grammars}, separators=(",", ":"))
