"""Speculative decoding in the engine (n-gram drafts): the tokens are plain decoding's, stops
cut where plain decoding stops, rows of every kind speculate side by side, and the block pool
adds up after every step."""

from __future__ import annotations

import pytest

from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel
from generation.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine
from tests.engine.speculation_helpers import GREEDY, PROMPTS, both, run


@pytest.mark.parametrize(
    "config",
    [
        {},  # Jitney's forward, decode attention in place (the CPU default)
        {"decode_attention": "gather"},
        {"model_impl": "transformers"},
        {"num_speculative_tokens": 1, "prompt_lookup_min": 1},
        {"kv_cache_dtype": "float16"},  # a 16-bit pool: verified rows read the rounded K/V too
        {"kv_cache_dtype": "bfloat16", "decode_attention": "gather"},
    ],
)
def test_greedy_tokens_are_those_of_plain_decoding(loaded: LoadedModel, config: dict):
    plain, spec, engine = both(loaded, [(p, GREEDY) for p in PROMPTS], **config)
    assert spec == plain
    stats = engine.stats
    assert stats.num_verifications_total > 0
    assert 0 < stats.num_accepted_tokens_total <= stats.num_draft_tokens_total


def _mid_span(loaded: LoadedModel, prompt: list[int], search: bool = True) -> tuple[int, list[int]]:
    """The first occurrence of some token inside a step that gave several tokens, not at
    that step's end (so a stop there must cut the step's tokens); and the greedy output."""
    engine = make_engine(loaded, kv_cache_memory="16MiB", speculative="ngram")
    engine.add_request("r", prompt, GREEDY)
    steps: list[list[int]] = []
    while engine.has_unfinished():
        steps += [out.new_token_ids for out in engine.step() if out.new_token_ids]
    tokens = [t for step in steps for t in step]
    at = 0
    if not search:
        return -1, tokens
    for step in steps:
        for i in range(at, at + len(step) - 1):  # never a step's last token
            if tokens[i] not in tokens[:i] and i > at:
                return i, tokens
        at += len(step)
    raise AssertionError("no step gave several tokens with a new one before its last")


def test_stop_strings_and_stop_tokens_cut_where_plain_decoding_stops(loaded: LoadedModel):
    # A prompt that ends in the model's own greedy loop: its reply continues the loop, copied
    # from the prompt by the drafts, so tokens new to the reply come inside accepted spans.
    _, loop = _mid_span(loaded, PROMPTS[0], search=False)
    prompt = PROMPTS[0] + loop[:30]
    at, tokens = _mid_span(loaded, prompt)
    text = loaded.tokenizer.decode(tokens[: at + 1])
    # The shortest tail of the text up to that token that appears nowhere before it.
    stop = next(text[-n:] for n in range(1, len(text)) if text.find(text[-n:]) == len(text) - n)
    at_string = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    at_token = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(tokens[at],))
    plain, spec, engine = both(loaded, [(prompt, at_string), (prompt, at_token)])
    assert spec == plain
    assert [end[1] for _, end in plain.values()] == ["stop", "stop"]
    assert len(plain["r1"][0][0][1]) == at + 1  # ends with the stop token
    assert engine.stats.num_accepted_tokens_total > 0


def test_rows_of_every_kind_side_by_side_keep_plain_decoding_s_tokens(loaded: LoadedModel):
    sampled = SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=30, temperature=0, logprobs=2, ignore_eos=True)
    penalised = SamplingParams(
        max_tokens=30, temperature=0, repetition_penalty=1.3, ignore_eos=True
    )
    two = SamplingParams(max_tokens=30, temperature=0, n=2, ignore_eos=True)
    requests = [(PROMPTS[0], GREEDY), (PROMPTS[1], sampled), (PROMPTS[2], with_logprobs)]
    requests += [(PROMPTS[0], penalised), (PROMPTS[2], two)]
    plain, spec, engine = both(loaded, requests, speculative_max_step_tokens=64)
    assert spec == plain
    assert engine.stats.num_verifications_total > 0


def test_preempted_and_recomputed_speculating_sequences_keep_their_tokens(loaded: LoadedModel):
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    requests = [(p, long) for p in PROMPTS * 2]
    config = {"speculative_max_step_tokens": 64, "max_model_len": 256}
    off = make_engine(loaded, kv_cache_memory="160KiB", **config)
    on = make_engine(loaded, kv_cache_memory="160KiB", speculative="ngram", **config)
    plain, spec = run(off, requests), run(on, requests)
    assert spec == plain
    assert on.stats.num_preemptions_total > 0 and on.stats.num_accepted_tokens_total > 0


def test_a_full_batch_of_speculating_sequences_trimming_and_regrowing_blocks(loaded):
    """Twelve sequences verifying drafts every step: rejected drafts give blocks back that
    others take, and a sequence grows into a different block where its table had one."""
    prompts = [[(7 * i + 13 * j) % 250 + 3 for j in range(8 + i)] for i in range(12)]
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True, detokenize=False)
    plain, spec, engine = both(
        loaded, [(p, params) for p in prompts], speculative_max_step_tokens=64
    )
    assert spec == plain
    assert engine.stats.num_draft_tokens_total > engine.stats.num_accepted_tokens_total > 0


TEMPERATURE = 0.6  # peaked enough that draws often continue the prompt's loop


def test_sampled_rows_speculate_and_follow_the_model_s_distribution(
    loaded: LoadedModel, ref: LoadedModel
):
    """Verifying a draft by sampling the position and keeping the draft only if the sample
    equals it is rejection sampling for a draft that is a single token: the kept token is the
    model's draw. Over 600 seeds, the second token (the first that a verification gives) is
    tallied where the first one was the likeliest, against the model's own top-5 probabilities
    after it (chi-square, 4 degrees of freedom, p > 0.001)."""
    import torch

    # A prompt that ends in the model's own greedy loop: sampled near it, the draws often
    # continue the loop, and so equal the drafts copied from the prompt.
    _, loop = _mid_span(loaded, PROMPTS[0], search=False)
    prompt = PROMPTS[0] + loop[:30]
    params = [
        SamplingParams(max_tokens=3, temperature=TEMPERATURE, top_k=5, seed=seed, ignore_eos=True)
        for seed in range(1000)
    ]
    config = {"speculative_max_step_tokens": 8192, "max_num_seqs": 1000, "prompt_lookup_min": 1}
    plain, spec, engine = both(loaded, [(prompt, p) for p in params], **config)
    assert spec == plain  # each seed's draws are plain sampling's, position for position
    assert engine.stats.num_verifications_total >= 300
    assert engine.stats.num_accepted_tokens_total >= 100  # drafts kept by a sampled draw
    firsts = [r[0][0][1] for r in spec.values()]
    first = max({t[0] for t in firsts}, key=[t[0] for t in firsts].count)
    seconds = [t[1] for t in firsts if t[0] == first]
    with torch.no_grad():
        ids = torch.tensor([[*prompt, first]])
        logits = ref.model(ids).logits[0, -1].float()  # transformers' own attention
    top = logits.topk(5)
    probs = (top.values / TEMPERATURE).softmax(-1).tolist()
    counts = [seconds.count(t) for t in top.indices.tolist()]
    assert sum(counts) == len(seconds) >= 100  # top_k=5: nothing outside the five
    expected = [p * len(seconds) for p in probs]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    assert chi2 < 18.47, (counts, expected)  # the 0.999 quantile of chi-square(4)


def test_the_engine_prices_a_draft_row_from_its_own_decode_steps(loaded: LoadedModel):
    """Unless a cost is configured, every decode-only step within speculation's row cap is
    reported with its rows (its sequences and their drafts), a step with a prefill chunk
    never; a configured cost stays."""
    engine = make_engine(loaded, kv_cache_memory="16MiB", speculative="ngram")
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    stats, expected, verified = engine.stats, {}, 0
    most = engine.scheduler_config.speculative.max_step_tokens
    while engine.has_unfinished():
        drafted = stats.num_draft_tokens_total
        engine.step()
        drafts = stats.num_draft_tokens_total - drafted
        # Decodes only, within the rows a step may spend on drafts.
        if stats.num_batched_tokens == stats.batch_size + drafts <= most:
            expected[stats.num_batched_tokens] = expected.get(stats.num_batched_tokens, 0) + 1
            verified += drafts > 0
    seen = {rows: steps for rows, (steps, _) in engine.policy.speculator.row_cost.means.items()}
    assert seen == expected and verified  # steps with drafts among them
    assert 0.0 <= engine.view.draft_row_cost <= 1.0
    fixed = make_engine(
        loaded, kv_cache_memory="16MiB", speculative="ngram", speculative_draft_row_cost=0.3
    )
    run(fixed, [(p, GREEDY) for p in PROMPTS])
    assert fixed.view.draft_row_cost == 0.3 and not fixed.policy.speculator.row_cost.means


def test_drafts_from_earlier_replies_keep_plain_decoding_s_tokens(loaded: LoadedModel):
    """Requests one after another, the later asking what the earlier did (and a prompt of
    their reply's opening): drafts of the history's kinds are verified and kept, and every
    reply is plain decoding's, as with the history off."""
    prompt = PROMPTS[1]
    plain = make_engine(loaded, kv_cache_memory="16MiB", speculative="none")
    first = _alone(plain, prompt)
    requests = [prompt, prompt, [*prompt[-3:], *first[:6]]]
    want = [_alone(plain, p) for p in requests]
    for history_tokens in (0, 4096):
        engine = make_engine(
            loaded,
            kv_cache_memory="16MiB",
            speculative="ngram",
            speculative_draft_row_cost=0.0,
            speculative_history_tokens=history_tokens,
        )
        assert [_alone(engine, p) for p in requests] == want
        stats = engine.stats
        kept = stats.num_history_accepted_tokens_total
        assert (kept > 0) == bool(history_tokens)
        assert kept <= stats.num_history_draft_tokens_total <= stats.num_draft_tokens_total
        counts = engine.policy.speculator.odds.counts
        kinds = [kind for (kind, _), cell in counts.items() if cell[0]]
        assert any(kind < 0 for kind in kinds) == bool(history_tokens)


def _alone(engine: Engine, prompt: list[int]) -> list[int]:
    """One greedy request to its end on `engine` (its pools checked each step): its tokens."""
    ((_, tokens),), _ = run(engine, [(prompt, GREEDY)])["r0"]
    return tokens


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size(loaded: LoadedModel):
    """vLLM's disable_by_batch_size: steps planned with more running sequences than the cut-off
    verify nothing; once few enough are left, the survivor speculates; the tokens stay plain
    decoding's."""
    short = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    requests = [(PROMPTS[0], GREEDY), (PROMPTS[1], short), (PROMPTS[2], short)]
    config = {"speculative_disable_by_batch_size": 2, "speculative_draft_row_cost": 0.0}
    engine = make_engine(loaded, kv_cache_memory="16MiB", speculative="ngram", **config)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    stats, drafts_by_running = engine.stats, {}
    while engine.has_unfinished():
        drafted = stats.num_draft_tokens_total
        engine.step()
        running = stats.num_running
        drafts_by_running[running] = drafts_by_running.get(running, 0) + (
            stats.num_draft_tokens_total - drafted
        )
    assert drafts_by_running[3] == 0
    assert sum(d for running, d in drafts_by_running.items() if running <= 2) > 0
    plain, spec, _ = both(loaded, requests, **config)
    assert spec == plain
