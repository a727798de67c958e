"""Speculation for rows whose picks read more than the logits (engine/speculative.py): penalties,
bias and min_tokens over the drafts before each position, log-probs at every kept position, and
grammars (drafts cut where the grammar refuses, each position masked after the drafts before it,
the matcher advanced only by the kept tokens). Each with n-gram drafts and a draft model (the
target as its own, which proposes its unadjusted greedy picks)."""

from __future__ import annotations

import re

import llguidance
import pytest

from engine.models.model_loader import LoadedModel
from generation.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine
from tests.engine.speculation_helpers import PROMPTS, both

PROPOSERS = {
    "ngram": {"speculative_max_step_tokens": 64},
    "draft": {"speculative_model": "tiny-random", "speculative_max_step_tokens": 64},
}


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_penalised_biased_and_min_tokens_rows_keep_plain_decoding_s_tokens(
    loaded: LoadedModel, proposer: str
):
    """Each position's penalties count the drafts before it, and min_tokens holds the stop
    tokens back by the position's own output index (greedy and seeded rows)."""
    stop = PROMPTS[0][1]  # a token the replies to PROMPTS[0] are full of, held back 12 tokens
    kinds = [
        {"frequency_penalty": 0.3, "ignore_eos": True},
        {"presence_penalty": 0.5, "ignore_eos": True},
        {"repetition_penalty": 1.1, "ignore_eos": True},
        {"logit_bias": ((PROMPTS[0][2], 1.5),), "ignore_eos": True},
        {"min_tokens": 12, "stop_token_ids": (stop,)},
    ]
    requests = [
        (prompt, SamplingParams(max_tokens=30, temperature=temperature, seed=i, **kind))
        for i, kind in enumerate(kinds)
        for temperature in (0, 0.5)
        for prompt in PROMPTS[:2]
    ]
    plain, spec, engine = both(loaded, requests, **PROPOSERS[proposer])
    assert spec == plain
    assert engine.stats.num_accepted_tokens_total >= 10


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_every_kept_position_reports_plain_decoding_s_log_probs(loaded: LoadedModel, proposer: str):
    requests = [
        (prompt, SamplingParams(max_tokens=30, temperature=t, seed=3, logprobs=3, ignore_eos=True))
        for t in (0, 0.5)
        for prompt in PROMPTS
    ]
    plain, spec, engine = both(loaded, requests, logprobs=True, **PROPOSERS[proposer])
    assert {r: v[:2] for r, v in spec.items()} == {r: v[:2] for r, v in plain.items()}
    for rid, (*_, found) in spec.items():
        want = plain[rid][2]
        assert len(found) == len(want) == 30
        for (logprob, top), (want_logprob, want_top) in zip(found, want, strict=True):
            assert logprob == pytest.approx(want_logprob, abs=1e-4) and top == want_top
    assert engine.stats.num_accepted_tokens_total >= 10


REPEATS = "abc abc abc abc abc abc "


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_grammar_rows_keep_plain_decoding_s_tokens_and_end_where_it_ends(
    loaded: LoadedModel, proposer: str
):
    """A grammar that repeats what the prompt repeats (so n-gram drafts pass its mask) and is
    complete after four repeats, often inside a verified span: it ends there, as plain decoding
    does; a regex with choices, greedy and sampled, beside it."""
    tokenizer = loaded.tokenizer
    four = llguidance.LLMatcher.grammar_from_regex(r"(abc ){4}")
    choice = llguidance.LLMatcher.grammar_from_regex(r"((abc|abd) ){2,8}end")
    prompt = tokenizer.encode(REPEATS)
    requests = [
        (prompt, SamplingParams(max_tokens=40, temperature=0, grammar=four)),
        (prompt, SamplingParams(max_tokens=40, temperature=0, grammar=choice)),
        (prompt, SamplingParams(max_tokens=40, temperature=0.8, seed=1, grammar=choice)),
        (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, grammar=choice)),
    ]
    config = {**PROPOSERS[proposer], "num_speculative_tokens": 8}
    plain, spec, engine = both(loaded, requests, **config)
    assert spec == plain
    assert plain["r0"][1] == ("abc abc abc abc ", "stop")
    for rid in ("r1", "r2", "r3"):
        text, reason = plain[rid][1]
        assert reason == "stop" and re.fullmatch(r"((abc|abd) ){2,8}end", text), text
    if proposer == "ngram":  # (a draft model's unconstrained picks are mostly cut to nothing)
        assert engine.stats.num_accepted_tokens_total >= 10


def test_drafts_stop_before_the_first_token_the_grammar_refuses(loaded: LoadedModel):
    """Prompt lookup proposes what followed the tail "y z x y" in the prompt: "z x y"; the
    grammar allows "z x", then only "q": the scheduler sees two drafts."""
    tokenizer = loaded.tokenizer
    engine = make_engine(loaded, kv_cache_memory="16MiB", speculative="ngram")
    grammar = llguidance.LLMatcher.grammar_from_regex(r"zxq*")
    params = SamplingParams(max_tokens=8, temperature=0, grammar=grammar)
    engine.add_request("r", tokenizer.encode("xyzxyzxy"), params)
    seq = engine.policy.seqs["r"]
    proposer = engine.policy.speculator.proposer
    assert proposer is not None
    inner = proposer.inner  # type: ignore[attr-defined]
    assert inner.propose(seq, 4).tokens == tokenizer.encode("zxy")
    assert proposer.propose(seq, 4).tokens == tokenizer.encode("zx")
