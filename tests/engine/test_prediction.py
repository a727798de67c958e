"""Predicted outputs in the engine: a prediction changes how many steps a reply takes, never its
tokens (greedy or seeded sampling, right or wrong or edited prediction, several choices), and a
prediction outside the vocabulary is refused before anything is queued."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.errors import PredictionError
from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel
from generation.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine

PROMPT = [5, 17, 42, 99, 120, 7, 61]
GREEDY = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)


def engine_for(loaded: LoadedModel) -> Engine:
    # Earlier replies off: the drafts come from the prediction or the reply's own text only.
    return make_engine(loaded, kv_cache_memory="16MiB", speculative_history_tokens=0)


def reply(loaded: LoadedModel, params: SamplingParams, prediction: list[int] = ()):
    """The reply's tokens, drafts verified and kept, with `prediction`."""
    engine = engine_for(loaded)
    params = replace(params, prediction_token_ids=tuple(prediction))
    out = engine.generate([PROMPT], params)
    stats = engine.stats
    return out[0].token_ids, stats.num_draft_tokens_total, stats.num_accepted_tokens_total


def test_the_reply_itself_as_prediction_is_drafted_whole_and_kept(loaded: LoadedModel):
    plain, _, plain_kept = reply(loaded, GREEDY)
    tokens, drafted, kept = reply(loaded, GREEDY, plain)
    assert tokens == plain
    assert kept == drafted >= 50 > plain_kept  # every token after the first was a kept draft


def test_an_edited_prediction_is_followed_past_the_edits(loaded: LoadedModel):
    plain, _, plain_kept = reply(loaded, GREEDY)
    edited = [*plain[:10], 3, *plain[10:20], *plain[23:40], 1, 2, *plain[41:]]
    tokens, _, kept = reply(loaded, GREEDY, edited)
    assert tokens == plain
    assert kept > plain_kept + 20


def test_a_wrong_prediction_costs_no_token(loaded: LoadedModel):
    plain, _, _ = reply(loaded, GREEDY)
    assert reply(loaded, GREEDY, [1, 2, 3, 4] * 20)[0] == plain
    assert reply(loaded, GREEDY, list(reversed(plain)))[0] == plain


def test_seeded_sampling_keeps_its_draws_with_a_prediction(loaded: LoadedModel):
    sampled = SamplingParams(max_tokens=60, temperature=0.8, seed=11, ignore_eos=True)
    plain, _, _ = reply(loaded, sampled)
    tokens, _, kept = reply(loaded, sampled, plain)
    assert tokens == plain and kept > 40


def test_each_choice_follows_the_prediction_on_its_own(loaded: LoadedModel):
    plain, _, _ = reply(loaded, GREEDY)
    engine = engine_for(loaded)
    both = replace(GREEDY, n=2, prediction_token_ids=tuple(plain))
    engine.add_request("r", PROMPT, both)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    kept: dict[int, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.index] += out.new_token_ids
            if out.finished:
                kept[out.index] = out.num_accepted_tokens
    assert tokens == {0: plain, 1: plain}  # greedy: both choices are the one reply
    assert kept[0] >= 40 and kept[1] >= 40


def test_a_prediction_outside_the_vocabulary_is_refused(loaded: LoadedModel):
    engine = engine_for(loaded)
    bad = replace(GREEDY, prediction_token_ids=(1, engine.vocab_size))
    with pytest.raises(PredictionError, match="outside the vocabulary"):
        engine.add_request("r", PROMPT, bad)
    assert not engine.has_unfinished()
