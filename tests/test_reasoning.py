"""Reasoning parsers (generation.reasoning): a scripted output, its token stream split at every
byte boundary (the tiny tokenizer spends a token per byte) and through the detokenizer, splits
into the same reasoning and content as the whole text, which a plain reference (str methods on
the whole text) gives; the grammar that holds for the content only; the gateway's flag."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher

from engine.models.tiny_model import build_tiny_tokenizer
from gateway.config import GatewayConfig, parse_reasoning_parsers
from generation import grammar as g
from generation.detokenizer import IncrementalDetokenizer
from generation.reasoning import (
    FORMATS,
    Phase,
    ReasoningFormat,
    ReasoningStream,
    content_grammar,
    split,
)
from jitney.cli import build_parser
from jitney.commands import gateway as gateway_command

TOKENIZER = build_tiny_tokenizer()


def byte_ids(text: str) -> list[int]:
    """`text` a token per byte (the tiny tokenizer's byte b is id 3 + b; its merges unused), so
    every byte boundary is a token boundary."""
    return [3 + b for b in text.encode()]


R1, QWEN3, GRANITE = FORMATS["deepseek_r1"], FORMATS["qwen3"], FORMATS["granite"]
# A prompt's end for each phase: nothing said, the template opened, the template closed.
PROMPT = {Phase.OPENING: "<|im_start|>assistant\n", Phase.REASONING: "<think>\n"}
PROMPT[Phase.CONTENT] = "<think>\n\n</think>\n\n"
GRANITE_PROMPT = {Phase.OPENING: "", Phase.REASONING: "Here is my thought process:"}
GRANITE_PROMPT[Phase.CONTENT] = "Here's my response:\n"


def prompt_for(fmt: ReasoningFormat, phase: Phase) -> str:
    return (GRANITE_PROMPT if fmt is GRANITE else PROMPT)[phase]


def reference(fmt: ReasoningFormat, phase: Phase, text: str) -> tuple[str, str]:
    """The rule on the whole text, as the module docstring states it."""
    if phase is Phase.CONTENT:
        return "", text
    if phase is Phase.OPENING:
        opened = [m for m in fmt.starts if text.lstrip().startswith(m)]
        if opened:
            text = text.lstrip()[len(opened[0]) :]
        elif not fmt.implicit_start:
            return "", text
    ends = sorted((text.find(m), m) for m in fmt.ends if m in text)
    if not ends:
        return text.strip(), ""
    end, marker = ends[0]
    return text[:end].strip(), text[end + len(marker) :].lstrip()


def streamed(
    fmt: ReasoningFormat, prompt: str, ids: list[int], cuts: list[int]
) -> tuple[str, str, ReasoningStream]:
    """The output's token ids through the detokenizer and the stream, as replies of the ids
    between consecutive `cuts` (each reply's tokens fed one at a time, as a choice does)."""
    detok = IncrementalDetokenizer.create(TOKENIZER, TOKENIZER.encode(prompt))
    stream = ReasoningStream.after_prompt(fmt, prompt)
    reasoning, content = [], []
    bounds = [0, *sorted(set(cuts)), len(ids)]
    for lo, hi in itertools.pairwise(bounds):
        for token in ids[lo:hi]:
            r, c = stream.feed(detok.add(token), 1)
            reasoning.append(r)
            content.append(c)
    for r, c in (stream.feed(detok.finish()), stream.finish()):
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content), stream


OUTPUTS = [
    "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.",
    "  <think>é 日本</think>🙂 done",
    "no reasoning at all <think> here </think> x",
    "reasoning without a start</think>\n\nanswer",
    "<think>never closed <\n",
    "<thi",
    "\n\n",
    "a</think",
    "Here is my thought process: think é </thi Here's my response:\n ok",
    "Here's my thought process:only thinking",
]


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("phase", list(Phase), ids=[p.value for p in Phase])
def test_every_byte_boundary_splits_as_the_whole_text(fmt: ReasoningFormat, phase: Phase) -> None:
    """Each scripted output, its bytes cut into two replies at every boundary (inside the
    markers and inside multi-byte characters too), and one byte a reply."""
    prompt = prompt_for(fmt, phase)
    assert fmt.phase_after(prompt) is phase
    for text in OUTPUTS:
        ids = byte_ids(text)
        assert TOKENIZER.decode(ids) == text
        want = reference(fmt, phase, text)
        assert split(fmt, text, prompt) == want, text
        for cut in range(len(ids) + 1):
            assert streamed(fmt, prompt, ids, [cut])[:2] == want, (text, cut)
        assert streamed(fmt, prompt, ids, list(range(len(ids))))[:2] == want


PIECES = ["<think>", "</think>", "<th", "</", "ink>", " ", "\n", "a", "é", "日", "🙂", "<"]
PIECES += ["Here is my thought process:", "Here's my response:", "Here is my", "response:"]


@settings(max_examples=300, deadline=None)
@given(
    fmt=st.sampled_from(list(FORMATS.values())),
    phase=st.sampled_from(list(Phase)),
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    cuts=st.lists(st.integers(0, 200), max_size=6),
)
def test_any_stream_splits_as_the_whole_text(
    fmt: ReasoningFormat, phase: Phase, pieces: list[str], cuts: list[int]
) -> None:
    """Markers, their prefixes, whitespace and multi-byte characters in any order, the token
    stream cut anywhere: the same split as the reference, so no marker that ends or opens the
    reasoning ever reaches the content (nor the reasoning)."""
    text = "".join(pieces)
    ids = byte_ids(text)
    cuts = [c for c in cuts if c < len(ids)]
    reasoning, content, _ = streamed(fmt, prompt_for(fmt, phase), ids, cuts)
    assert (reasoning, content) == reference(fmt, phase, text)


def test_the_reasoning_tokens_are_counted_with_the_end_marker() -> None:
    text = "<think>\nab\n</think>\n\nc d"
    *_, stream = streamed(QWEN3, "", byte_ids(text), [])
    assert stream.num_reasoning_tokens == len("<think>\nab\n</think>")
    *_, content_only = streamed(QWEN3, "", byte_ids("plain answer"), [])
    assert content_only.num_reasoning_tokens == 0
    *_, opened = streamed(R1, "<think>\n", byte_ids("all thought"), [])
    assert opened.num_reasoning_tokens == len("all thought")


def test_where_an_output_starts_is_read_from_the_prompt() -> None:
    """Qwen3's `enable_thinking: false` closes the reasoning in the prompt; DeepSeek-R1's and
    Qwen3.5's templates open it; other prompts leave it to the output."""
    assert QWEN3.phase_after("<|im_start|>assistant\n<think>\n\n</think>\n\n") is Phase.CONTENT
    assert R1.phase_after("<｜Assistant｜><think>\n") is Phase.REASONING
    assert QWEN3.phase_after("<think>old</think> answer<|im_end|>\n<|im_start|>assistant\n") is (
        Phase.OPENING
    )
    assert split(QWEN3, "plain", "<think>\n\n</think>\n\n") == ("", "plain")
    assert split(R1, "plain") == ("plain", "")  # DeepSeek-R1: reasoning until the end marker
    assert split(QWEN3, "plain") == ("", "plain")  # Qwen3: only when opened


# --- the grammar for the content only ---------------------------------------------------------

LLTOKENIZER = g.make_tokenizer(
    TOKENIZER.backend_tokenizer.to_str(), len(TOKENIZER), [TOKENIZER.eos_token_id]
)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CALL = 'start: "<tool_call>" %json {"type": "object"} "</tool_call>"'
GRAMMARS = {"json": g.json_schema(SCHEMA), "regex": g.regex("[a-z]+"), "lark": g.lark(CALL)}
CONTENTS = {"json": '{"a":1}', "regex": "yes", "lark": "<tool_call>{}</tool_call>"}


def accepts(grammar: str, text: str) -> bool:
    matcher = LLMatcher(LLTOKENIZER, grammar, log_level=0)
    ok = all(matcher.consume_token(t) for t in TOKENIZER.encode(text))
    return ok and matcher.is_accepting()


@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("phase", list(Phase), ids=[p.value for p in Phase])
def test_the_grammar_holds_for_the_content_after_the_reasoning(
    kind: str, fmt: ReasoningFormat, phase: Phase
) -> None:
    """The wrapped grammar compiles; it accepts an output exactly when the content the stream
    splits off is the inner grammar's (the reasoning before it free, closed by its marker)."""
    grammar = content_grammar(fmt, phase, GRAMMARS[kind])
    assert g.validate(grammar, LLTOKENIZER) is None
    good, prompt = CONTENTS[kind], prompt_for(fmt, phase)
    start, end = fmt.starts[-1], fmt.ends[-1]
    outputs = [good, f"{start}\nfree {{ text\n{end}\n\n{good}", f"x{end} {good}", f"{start}{good}"]
    outputs += [f"{start}x{end}{good}!", f"x{end}"]
    for text in outputs:
        _, content = split(fmt, text, prompt)
        assert accepts(grammar, text) == (content == good), (text, content)
    if phase is Phase.CONTENT:
        assert grammar == GRAMMARS[kind]  # nothing to wrap


# --- the gateway's flag ---------------------------------------------------------------------------


def test_the_flag_names_a_parser_for_every_model_or_per_model() -> None:
    pairs = parse_reasoning_parsers("qwen3, tiny-b=deepseek_r1,org/m=granite")
    assert pairs == (("", "qwen3"), ("tiny-b", "deepseek_r1"), ("org/m", "granite"))
    config = GatewayConfig(reasoning_parsers=pairs)
    assert config.reasoning_format("tiny-b") is R1 and config.reasoning_format("x") is QWEN3
    assert GatewayConfig().reasoning_format("x") is None
    only = GatewayConfig(reasoning_parsers=parse_reasoning_parsers("tiny-b=granite"))
    assert only.reasoning_format("x") is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope' \\(known: deepseek_r1"):
        GatewayConfig(reasoning_parsers=parse_reasoning_parsers("m=nope"))
    with pytest.raises(ValueError, match="two reasoning parsers"):
        GatewayConfig(reasoning_parsers=parse_reasoning_parsers("qwen3,granite"))


def test_the_gateway_refuses_an_unknown_parser_at_start(caplog: pytest.LogCaptureFixture) -> None:
    args = build_parser(["gateway"]).parse_args(["gateway", "--reasoning-parser", "qwen3,m=nope"])
    assert gateway_command.run(args) == 2
    assert "unknown reasoning parser 'nope'" in caplog.text
