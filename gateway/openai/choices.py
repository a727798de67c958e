"""One choice of a response: its replies' token ids become text (and log-probs, echo, reasoning,
tool calls), and it remembers how it ended. A request with `n` choices has n of these, each with
its own detokenizer (stop strings are per choice), reasoning splitter and tool-call parser.

The text goes through them in that order: the detokenizer's text is split into reasoning and
content (a model with a reasoning parser), and only the content is read for tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.openai.logprobs_format import LogprobsFormatter, merge
from gateway.openai.tool_parser import ToolCall, ToolStream
from generation.detokenizer import IncrementalDetokenizer
from generation.reasoning import ReasoningStream
from protocol import ReplyMessage

NORMAL_FINISH = frozenset({"stop", "length"})


@dataclass(slots=True)
class Echo:
    """Completions' `echo`: the prompt sent back before the choice's text."""

    text: str
    token_ids: list[int]


@dataclass(slots=True)
class Delta:
    """What one reply adds to a choice."""

    text: str = ""
    logprobs: dict[str, Any] | None = None
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None  # set when the choice ended with this reply
    reasoning: str = ""  # reasoning text (`text` is then the content)

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.logprobs or self.calls)


@dataclass(slots=True)
class Choice:
    index: int
    detok: IncrementalDetokenizer
    logprobs: LogprobsFormatter | None = None
    tools: ToolStream | None = None  # parse tool calls out of the text
    reasoning: ReasoningStream | None = None  # split the text into reasoning and content
    echo: Echo | None = None  # still to send (with the choice's first reply)
    hide_output: bool = False  # max_tokens 0 with echo: the one token generated is not shown
    keep: bool = False  # collect the deltas (a non-streamed response)
    num_tokens: int = 0
    completion_tokens: int = 0  # as the worker's final reply counts them
    # speculation, as the worker's final reply counts it: draft tokens verified, those kept
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    finish_reason: str | None = None  # set once the choice ended (here or in the worker)
    worker_done: bool = False  # the worker's final reply for this choice arrived
    _parts: list[Delta] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped(self) -> bool:
        """Ended by a stop string found here (the worker may still be generating it)."""
        return self.detok.stopped

    def add(self, reply: ReplyMessage, prompt_logprobs: list[list[Any]] | None) -> Delta:
        """Apply one of the worker's replies for this choice (normal ones only)."""
        if reply.is_final:
            self.worker_done = True
            if reply.completion_tokens:
                self.completion_tokens = reply.completion_tokens
            self.draft_tokens = reply.draft_tokens
            self.accepted_draft_tokens = reply.accepted_draft_tokens
        if self.done:  # ended here by a stop string: what the worker made since is not shown
            return Delta()
        delta = self._echo(prompt_logprobs)
        texts: list[tuple[str, int]] = []  # each token's text, then what finishing released
        if not self.hide_output:
            self.num_tokens += len(reply.token_ids)
            texts = [(self.detok.add(token), 1) for token in reply.token_ids]
            if reply.finish_reason in NORMAL_FINISH:
                texts.append((self.detok.finish(), 0))
            delta.text += "".join(text for text, _ in texts)
            if self.logprobs is not None and reply.token_ids:
                part = self.logprobs.part(reply.token_ids, reply.logprobs)
                delta.logprobs = part if delta.logprobs is None else merge([delta.logprobs, part])
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif reply.finish_reason in NORMAL_FINISH:
            self.finish_reason = "length" if self.hide_output else reply.finish_reason
        self._split_reasoning(delta, texts)
        self._parse_calls(delta)
        if self.done:
            delta.finish_reason = self.final_reason
        if self.keep:
            self._parts.append(delta)
        return delta

    @property
    def usage_tokens(self) -> int:
        if self.hide_output:
            return 0
        if self.stopped:  # what was received (the worker's count may include more)
            return self.num_tokens
        return self.completion_tokens or self.num_tokens

    @property
    def reasoning_tokens(self) -> int:
        return 0 if self.reasoning is None else self.reasoning.num_reasoning_tokens

    @property
    def reasoning_text(self) -> str | None:
        """The whole choice's reasoning (kept deltas): None without a reasoning parser, or
        when the output had none."""
        return "".join(d.reasoning for d in self._parts) or None

    def result(self) -> tuple[str | None, dict[str, Any] | None, list[ToolCall], str]:
        """The whole choice (kept deltas): content, logprobs, calls, finish_reason. The content
        is None when empty beside calls or reasoning."""
        calls = [c for d in self._parts for c in d.calls]
        text: str | None = "".join(d.text for d in self._parts)
        if (calls or self.reasoning_text) and not text:
            text = None
        logprobs = None
        if self.logprobs is not None:  # asked for: an empty object when no token came
            parts = [d.logprobs for d in self._parts if d.logprobs]
            logprobs = merge(parts) or self.logprobs.part([], [])
        return text, logprobs, calls, self.final_reason

    @property
    def final_reason(self) -> str:
        reason = self.finish_reason or "stop"
        if reason == "stop" and self.tools is not None and self.tools.num_calls:
            return "tool_calls"
        return reason

    def _echo(self, prompt_logprobs: list[list[Any]] | None) -> Delta:
        if self.echo is None:
            return Delta()
        echo, self.echo = self.echo, None
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs.prompt_part(echo.token_ids, prompt_logprobs, len(echo.text))
        return Delta(echo.text, logprobs)

    def _split_reasoning(self, delta: Delta, texts: list[tuple[str, int]]) -> None:
        """Reasoning: the text becomes reasoning and content (held-back text waits). Fed a
        token at a time (text, tokens), so that the stream counts the reasoning's tokens."""
        if self.reasoning is None:
            return
        parts = [self.reasoning.feed(text, n) for text, n in texts]
        if self.done:
            parts.append(self.reasoning.finish())
        delta.reasoning = "".join(r for r, _ in parts)
        delta.text = "".join(c for _, c in parts)

    def _parse_calls(self, delta: Delta) -> None:
        """Tool calls: the text becomes content and calls (held-back text waits)."""
        if self.tools is None:
            return
        parts = self.tools.feed(delta.text)
        if self.done:
            parts += self.tools.finish()
        delta.text = "".join(p for p in parts if isinstance(p, str))
        delta.calls = [p for p in parts if isinstance(p, ToolCall)]
