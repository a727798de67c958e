"""Incremental detokenization: joined deltas are the final text; stop strings end it cleanly."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.tiny_model import build_tiny_tokenizer

TOKENIZER = build_tiny_tokenizer()
PROMPT = TOKENIZER.encode("hello")


def stream(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer.create(TOKENIZER, PROMPT, stop)
    deltas = []
    for token in TOKENIZER.encode(text):
        deltas.append(detok.add(token))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    return deltas, detok


def test_multibyte_characters_are_never_split():
    """Byte tokens of 'é', '日' and '🚀' are held until the character is complete."""
    deltas, _ = stream("é日🚀!")
    assert "".join(deltas) == "é日🚀!"
    assert all("\ufffd" not in d for d in deltas)
    assert [d for d in deltas if d] == ["é", "日", "🚀", "!"]


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=40).filter(lambda t: "<|" not in t),  # no special-token markup
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=2),
)
def test_joined_deltas_equal_the_final_text(text, stop):
    """For any text and stop strings: deltas join to the final text, cut before the first stop."""
    deltas, detok = stream(text, tuple(stop))
    assert "".join(deltas) == detok.text
    hits = [i for s in stop if (i := text.find(s)) != -1]
    assert detok.text == (text[: min(hits)] if hits else text)
    assert detok.stopped == bool(hits)


def test_stop_string_prefix_is_held_back_then_released():
    """'ab' might begin stop 'abc': held back; when 'd' follows, released."""
    detok = IncrementalDetokenizer.create(TOKENIZER, PROMPT, ("abc",))
    out = [detok.add(t) for t in TOKENIZER.encode("xab")]
    assert "".join(out) == "x"
    assert detok.add(TOKENIZER.encode("d")[0]) == "abd"


def test_stop_string_across_tokens_truncates_output():
    """A stop string split over several tokens ends the text just before it."""
    deltas, detok = stream("one two STOP three", ("STOP",))
    assert detok.stopped and detok.text == "one two "
    assert "".join(deltas) == "one two "


def test_special_tokens_are_not_rendered():
    """EOS and other special tokens produce no text."""
    detok = IncrementalDetokenizer.create(TOKENIZER, PROMPT)
    eos = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
    assert detok.add(TOKENIZER.encode("hi")[0]) == "h"
    assert detok.add(eos) == ""
    assert detok.finish() == ""


def test_finish_releases_an_incomplete_character():
    """A stream cut inside a multi-byte character ends with the replacement char, not silence."""
    detok = IncrementalDetokenizer.create(TOKENIZER, PROMPT)
    first_byte = TOKENIZER.encode("日")[0]
    assert detok.add(first_byte) == ""
    assert detok.finish() == "\ufffd"
