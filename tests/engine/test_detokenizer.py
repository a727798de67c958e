"""Incremental detokenization: joined deltas are the final text; stop strings end it cleanly."""

import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.models.model_loader import load_model
from engine.models.tiny_model import build_tiny_tokenizer
from generation.detokenizer import IncrementalDetokenizer

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
@example(text="0d0", stop=["d", "0d0"])  # found by hypothesis: "d" completes first
def test_joined_deltas_equal_the_final_text(text, stop):
    """For any text and stop strings: deltas join to the final text, cut before the first stop
    string to complete as the text grows (one character a token here): with overlapping stops
    ("0d0" and "d" in "0d0"), the one that completes first wins, wherever the other starts."""
    deltas, detok = stream(text, tuple(stop))
    assert "".join(deltas) == detok.text
    want, stopped = text, False
    for end in range(1, len(text) + 1):
        hits = [i for s in stop if (i := text[:end].find(s)) != -1]
        if hits:
            want, stopped = text[: min(hits)], True
            break
    assert detok.text == want
    assert detok.stopped == stopped


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


# ----- other tokenizer families, takeover replay, and the decode() property --------------------


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2's SentencePiece shape in tokenizers' terms: '▁' for spaces, byte-fallback tokens
    for characters not in the vocabulary, and a decoder that strips the text's leading space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = []
    for word in ["▁Hello", "▁world", "▁the", "▁and", "▁is"]:
        prefix = word[0]
        vocab.setdefault(prefix, len(vocab))
        for char in word[1:]:
            vocab.setdefault(char, len(vocab))
            if prefix + char not in vocab:
                merges.append((prefix, char))
                vocab[prefix + char] = len(vocab)
            prefix += char
    for char in "!,.":
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerBase]:
    return {
        "tiny-random": TOKENIZER,
        "sentencepiece-style": sentencepiece_style_tokenizer(),
        "smollm2": load_model("smollm2-135m").tokenizer,
    }


def test_sentencepiece_first_output_token_keeps_its_space(tokenizers):
    """'▁world' alone decodes to 'world'; after the prompt's context it is ' world'."""
    tok = tokenizers["sentencepiece-style"]
    world = tok.convert_tokens_to_ids("▁world")
    assert tok.decode([world]) == "world"
    detok = IncrementalDetokenizer.create(tok, tok.encode("Hello", add_special_tokens=False))
    assert detok.add(world) == " world"


def test_byte_fallback_character_is_held_until_complete(tokenizers):
    """'日' as three byte tokens: nothing until the third, then the whole character."""
    tok = tokenizers["sentencepiece-style"]
    ids = tok.encode("Hello 日!", add_special_tokens=False)
    bytes_of_ri = tok.convert_tokens_to_ids(["<0xE6>", "<0x97>", "<0xA5>"])
    assert ids[-4:-1] == bytes_of_ri
    detok = IncrementalDetokenizer.create(tok, ids[:1])
    assert [detok.add(t) for t in ids[1:]] == [" ", "", "", "日", "!"]


@pytest.mark.parametrize("k", range(0, 13))
def test_takeover_replay_continues_with_no_repeat_or_gap(k):
    """A worker that takes a request over replays the k delivered tokens (their deltas already
    sent) and emits the rest: the client's joined text is the no-fault text, whatever k, also
    when the takeover falls inside a multi-byte character or a forming stop string."""
    ids = TOKENIZER.encode("a é日 STO STOP z")
    whole, _ = stream("a é日 STO STOP z", ("STOP",))
    first = IncrementalDetokenizer.create(TOKENIZER, PROMPT, ("STOP",))
    delivered = [first.add(t) for t in ids[:k]]
    taker = IncrementalDetokenizer.create(TOKENIZER, PROMPT, ("STOP",))
    for token in ids[:k]:
        taker.add(token)  # the replay: its deltas were delivered by the first worker
    rest = []
    for token in ids[k:]:
        if taker.stopped:
            break
        rest.append(taker.add(token))
    rest.append(taker.finish())
    assert "".join(delivered + rest) == "".join(whole) == "a é日 STO "


def token_ids(tok: PreTrainedTokenizerBase) -> st.SearchStrategy[list[int]]:
    """Runs of ids anywhere in the vocabulary (special tokens, stray bytes of byte-level BPE) and
    of encoded text (multi-byte characters split over tokens). Byte-fallback tokens only come
    from text: a run of them with one invalid byte decodes to U+FFFD for every byte of the run,
    the valid ones before it included, which no stream can match once those are sent."""
    byte_fallback = re.compile(r"<0x[0-9A-F]{2}>")
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    ids = [i for i, t in enumerate(tokens) if not byte_fallback.fullmatch(t)]
    anywhere = st.lists(st.sampled_from(ids), max_size=12)
    text = st.text(max_size=12).map(lambda t: tok.encode(t, add_special_tokens=False))
    return st.lists(anywhere | text, max_size=4).map(lambda runs: [t for r in runs for t in r])


@pytest.mark.parametrize("name", ["tiny-random", "sentencepiece-style", "smollm2"])
def test_joined_deltas_equal_decoding_all_ids(tokenizers, name):
    """Property, per tokenizer: for a text prompt and any output ids, the joined deltas are
    exactly what `tokenizer.decode(prompt + output, skip_special_tokens=True)` adds to the
    prompt's own text, and no delta but the last ends inside a character."""
    tok = tokenizers[name]

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(prompt=st.text(min_size=1, max_size=12), output=token_ids(tok))
    def check(prompt: str, output: list[int]) -> None:
        prompt_ids = tok.encode(prompt, add_special_tokens=False) or [tok.eos_token_id]
        detok = IncrementalDetokenizer.create(tok, prompt_ids)
        deltas = [detok.add(t) for t in output]
        deltas.append(detok.finish())
        before = tok.decode(prompt_ids, skip_special_tokens=True)
        after = tok.decode(prompt_ids + output, skip_special_tokens=True)
        assert after.startswith(before)
        assert "".join(deltas) == after[len(before) :]
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])

    check()


def test_prompt_ending_inside_a_character_emits_only_the_output():
    """A token-id prompt may end inside a character: the output's first bytes complete it, and
    only what follows is emitted (the prompt's own text is never repeated)."""
    ids = TOKENIZER.encode("ab日x")
    detok = IncrementalDetokenizer.create(TOKENIZER, ids[:-2])
    assert [detok.add(t) for t in ids[-2:]] == ["", "x"]
    assert detok.finish() == ""
