"""Prompt log-probs (completions' echo): every prompt token's log-prob and alternatives, equal to
transformers' own log-softmax over the same tokens, however the prompt was scheduled."""

import random

import pytest

from generation import SamplingParams
from tests.engine.engine_helpers import make_engine, next_token_logprobs


def assert_matches_reference(ref, prompt, found, k):
    rows = next_token_logprobs(ref, prompt)
    assert len(found) == len(prompt) - 1
    for position, lp in enumerate(found, start=1):
        row = rows[position - 1]  # the distribution after prompt[:position]
        assert lp.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(k).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)


PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)


def test_prompt_logprobs_match_transformers_across_chunks_and_prefix_hits(loaded, ref):
    """A prompt prefilled in chunks of 7 tokens, beside a request that put the same prefix in the
    prefix cache: the log-probs are still those of every position (no cache hit is taken)."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 280) for _ in range(24)]
    prompts = [shared + [rng.randrange(3, 280) for _ in range(n)] for n in (5, 11)]
    engine = make_engine(loaded, block_size=4, max_num_batched_tokens=7, max_num_seqs=4)
    engine.generate([shared], SamplingParams(max_tokens=1, temperature=0))  # caches the prefix
    results = engine.generate(prompts, PARAMS)
    for prompt, result in zip(prompts, results, strict=True):
        assert_matches_reference(ref, prompt, result.prompt_logprobs, 2)
        assert result.num_cached_tokens == 0
    # Without prompt log-probs the same prompt takes its hits.
    again = engine.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0))
    assert again[0].num_cached_tokens >= 24 and again[0].prompt_logprobs is None


def test_prompt_logprobs_survive_preemption_and_come_once(loaded, ref):
    """A pool too small for the batch: recomputed prompts do not repeat or lose positions, and
    the log-probs arrive once, with the request's first token."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 280) for _ in range(rng.randrange(10, 20))] for _ in range(5)]
    engine = make_engine(loaded, block_size=4, kv_cache_memory=str(14 * 2048), max_num_seqs=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1)
    seen: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    collected = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                seen[out.request_id] = seen.get(out.request_id, 0) + 1
                assert out.new_token_ids  # with the first token
                collected[out.request_id] = out.prompt_logprobs
    assert engine.stats.num_preemptions_total > 0
    assert seen == {f"r{i}": 1 for i in range(5)}
    for i, prompt in enumerate(prompts):
        assert_matches_reference(ref, prompt, collected[f"r{i}"], 1)


def test_a_one_token_prompt_has_no_prompt_logprobs_and_a_taken_over_one_skips_them(loaded):
    engine = make_engine(loaded)
    assert engine.generate([[7]], PARAMS)[0].prompt_logprobs == []
    engine.add_request("resumed", [7, 8, 9], PARAMS, output_token_ids=[10])
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert all(out.prompt_logprobs is None for out in outputs)  # the first reply had them
