"""The engine on the tiny model: greedy parity with transformers, seeds, aborts, integrity."""

import random
from dataclasses import replace

import pytest
import torch

from engine.errors import RequestTooLongError
from engine.llm_engine import Engine
from generation import SamplingParams
from tests.engine.engine_helpers import (
    assert_greedy_parity,
    make_engine,
    next_token_logprobs,
    reference_greedy,
)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 280) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run_staggered(
    engine: Engine, requests: list[tuple[int, list[int], int]]
) -> dict[str, list[int]]:
    """Add request i at step `join_step`; run to completion; return tokens per request id."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, n) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, greedy(n))
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
        assert step < 5000
    engine.block_manager.check_integrity()
    assert engine.view.kv_used_blocks == 0
    return tokens


def check_all(ref, requests, tokens):
    for (_, prompt, n), got in zip(requests, tokens.values(), strict=True):
        assert_greedy_parity(ref, prompt, got, reference_greedy(ref, prompt, n))


def test_requests_joining_and_leaving_mid_run_match_generate(loaded, ref):
    """Staggered arrivals and different lengths: each output equals generate() alone."""
    rng = random.Random(1)
    requests = [
        (rng.randrange(0, 12), random_prompt(rng, rng.randrange(3, 30)), rng.randrange(1, 25))
        for _ in range(10)
    ]
    engine = make_engine(loaded, max_num_seqs=4, kv_cache_memory="8MiB")
    check_all(ref, requests, run_staggered(engine, requests))


def test_chunked_prefill_matches_generate(loaded, ref):
    """Prompts longer than the token budget are prefilled over several steps beside decodes."""
    rng = random.Random(2)
    requests = [(i * 2, random_prompt(rng, rng.randrange(20, 60)), 12) for i in range(5)]
    engine = make_engine(loaded, max_num_batched_tokens=16, block_size=4, kv_cache_memory="8MiB")
    check_all(ref, requests, run_staggered(engine, requests))


def test_prefix_sharing_reuses_blocks_and_matches_generate(loaded, ref):
    """A request with a cached prompt prefix skips those tokens and still matches."""
    rng = random.Random(3)
    shared = random_prompt(rng, 24)
    requests = [
        (0, shared + random_prompt(rng, 5), 8),
        (3, shared + random_prompt(rng, 7), 8),
        (3, shared + random_prompt(rng, 2), 8),
    ]
    engine = make_engine(loaded, block_size=4, kv_cache_memory="8MiB")
    tokens = run_staggered(engine, requests)
    assert engine.block_manager.num_prefix_hits >= 2 * 24
    check_all(ref, requests, tokens)


@pytest.mark.parametrize("reserve", [False, True])
def test_forced_preemption_matches_generate(loaded, ref, reserve):
    """A KV pool too small for the batch: preemption by recompute (or reservation) keeps parity."""
    rng = random.Random(4)
    requests = [
        (0, random_prompt(rng, rng.randrange(8, 20)), rng.randrange(10, 30)) for _ in range(6)
    ]
    # tiny-random: 512 B of K/V per token; 2 KiB per block of 4 -> 14 blocks = 56 tokens.
    engine = make_engine(
        loaded,
        block_size=4,
        kv_cache_memory=str(14 * 2048),
        max_num_seqs=6,
        reserve_full_length=reserve,
    )
    tokens = run_staggered(engine, requests)
    preemptions = engine.stats.num_preemptions_total
    assert (preemptions == 0) if reserve else (preemptions > 0)
    check_all(ref, requests, tokens)


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_static_and_dynamic_batching_match_generate(loaded, ref, batching):
    """The run-to-completion policies produce the same greedy text on the real engine."""
    rng = random.Random(5)
    prompts = [random_prompt(rng, rng.randrange(3, 20)) for _ in range(5)]
    lengths = [rng.randrange(1, 15) for _ in prompts]
    engine = make_engine(loaded, batching=batching, max_num_seqs=2, max_queue_delay=0.0)
    results = engine.generate(prompts, [greedy(n) for n in lengths])
    for prompt, n, res in zip(prompts, lengths, results, strict=True):
        assert_greedy_parity(ref, prompt, res.token_ids, reference_greedy(ref, prompt, n))
    assert engine.view.kv_used_blocks == 0


def test_same_seed_same_output_whatever_the_batch(loaded):
    """A seeded sampled request gives the same tokens alone and in a crowded batch."""
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = make_engine(loaded).generate([prompt], params)[0].token_ids
    rng = random.Random(6)
    crowd = [random_prompt(rng, rng.randrange(3, 40)) for _ in range(7)]
    mixed = (
        make_engine(loaded, max_num_batched_tokens=32)
        .generate(
            [*crowd[:3], prompt, *crowd[3:]],
            [SamplingParams(max_tokens=15, temperature=0.8, ignore_eos=True)] * 3
            + [params]
            + [SamplingParams(max_tokens=15, temperature=0.8, ignore_eos=True)] * 4,
        )[3]
        .token_ids
    )
    assert alone == mixed


def test_seeded_request_draws_the_same_tokens_after_preemption(loaded):
    """A seeded request that is preempted (KV freed, recomputed on readmission) continues its
    random stream where it was: the same tokens as alone."""
    prompt = list(range(40, 60))
    params = SamplingParams(max_tokens=30, temperature=1.0, top_k=40, seed=3, ignore_eos=True)
    alone = make_engine(loaded).generate([prompt], params)[0].token_ids
    # 14 blocks of 4 tokens: the three requests cannot all hold their K/V at once.
    engine = make_engine(loaded, block_size=4, kv_cache_memory=str(14 * 2048), max_num_seqs=3)
    rng = random.Random(8)
    crowd = SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"crowd{i}", random_prompt(rng, 12), crowd)
    engine.add_request("seeded", prompt, params)  # the newest: preempted first
    tokens, preemptions = [], 0
    while engine.has_unfinished():
        if "seeded" in engine.choices.by_seq:
            preemptions = engine.choices.by_seq["seeded"].seq.num_preemptions
        tokens += [
            t for out in engine.step() if out.request_id == "seeded" for t in out.new_token_ids
        ]
    assert preemptions > 0
    assert tokens == alone


def test_abort_mid_generation_frees_every_block(loaded):
    """Aborting a running request returns all its blocks at once."""
    engine = make_engine(loaded, kv_cache_memory="4MiB")
    engine.add_request("a", list(range(5, 45)), greedy(50))
    engine.add_request("b", list(range(5, 25)), greedy(50))
    for _ in range(5):
        engine.step()
    assert engine.view.kv_used_blocks > 0
    [out] = engine.abort("a")
    assert out.finished and out.finish_reason == "abort" and out.num_output_tokens == 5
    engine.abort("b")
    assert engine.view.kv_used_blocks == 0 and not engine.has_unfinished()
    engine.block_manager.check_integrity()
    assert engine.abort("a") == []


def test_stop_conditions(loaded):
    """EOS stops unless ignore_eos; stop token ids and max_tokens give the right reasons."""
    engine = make_engine(loaded)
    prompt = list(range(40, 60))
    free_run = engine.generate([prompt], greedy(30))[0].token_ids
    stop_tok = free_run[4]
    first = free_run.index(stop_tok)
    res = engine.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop_tok,))
    )[0]
    assert res.finish_reason == "stop" and res.token_ids == free_run[: first + 1]
    assert engine.generate([prompt], greedy(3))[0].finish_reason == "length"


def test_stop_string_truncates_text(loaded):
    """A stop string ends generation and is cut from the text."""
    engine = make_engine(loaded)
    prompt = list(range(60, 80))
    text = engine.generate([prompt], greedy(30))[0].text
    stop = text[5:7]
    assert stop
    res = engine.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0, stop=(stop,), ignore_eos=True)
    )[0]
    assert res.finish_reason == "stop" and res.text == text[: text.index(stop)]


def test_too_long_requests_are_refused(loaded):
    """Over the context window (itself capped to the KV pool): a clear error, nothing queued."""
    engine = make_engine(loaded, block_size=4, kv_cache_memory=str(14 * 2048), max_model_len=50)
    with pytest.raises(RequestTooLongError, match=r"\(40 tokens\) \+ max_tokens \(20\) = 60 .* 50"):
        engine.add_request("x", list(range(5, 45)), greedy(20))
    assert not engine.has_unfinished()
    capped = make_engine(loaded, block_size=4, kv_cache_memory=str(14 * 2048))
    assert capped.max_model_len == 56  # 14 blocks x 4: larger requests could never fit
    with pytest.raises(RequestTooLongError):
        capped.add_request("y", list(range(5, 45)), greedy(17))
    capped.add_request("z", list(range(5, 45)), greedy(16))  # exactly the whole pool
    with pytest.raises(RuntimeError, match="idle"):
        capped.generate([[5, 6]], greedy(1))  # offline generate never mixes with live requests
    outputs = []
    while capped.has_unfinished():
        outputs += capped.step()
    assert outputs[-1].finished and outputs[-1].num_output_tokens == 16


def test_refuses_to_start_when_max_model_len_does_not_fit(loaded):
    """An explicit max_model_len larger than the KV cache stops start-up with the numbers."""
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        make_engine(loaded, block_size=4, kv_cache_memory=str(14 * 2048), max_model_len=100)


def test_abort_under_static_batching_still_finishes_batch_mates(loaded):
    """Aborting a static batch's last runner returns its finished batch-mates' final outputs."""
    engine = make_engine(loaded, batching="static", max_num_seqs=2)
    engine.add_request("short", list(range(5, 15)), greedy(1))
    engine.add_request("long", list(range(5, 25)), greedy(40))
    engine.step()
    engine.step()
    assert [o.finish_reason for o in engine.abort("long")] == ["abort"]
    finals = [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finals] == [("short", "length")]
    assert not engine.has_unfinished() and not engine.choices.by_seq


def run_one(engine: Engine, prompt: list[int], params: SamplingParams, **kw) -> tuple[list, list]:
    """Tokens and the text delta that came with each token (one a step: no speculation)."""
    engine.add_request("r", prompt, params, **kw)
    tokens, deltas = [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.new_token_ids) == 1
            tokens += out.new_token_ids
            deltas.append(out.delta_text)
    assert engine.view.kv_used_blocks == 0
    return tokens, deltas


@pytest.mark.parametrize(
    "params",
    [
        greedy(24),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_taken_over_request_continues_after_the_delivered_tokens(loaded, params):
    """A worker taking a request over from a dead one gets the tokens already delivered: it
    recomputes their K/V and continues with exactly the tokens and text a no-fault run gives."""
    prompt = random_prompt(random.Random(5), 37)
    # Without speculation, so that each delta is one token's (speculating takeovers: the fault
    # tests in tests/service/test_faults.py).
    whole_tokens, whole_deltas = run_one(make_engine(loaded, speculative="none"), prompt, params)
    assert len(set(whole_tokens)) > 3  # a real continuation, not one repeated token
    for k in (1, 9, 23):
        engine = make_engine(loaded, speculative="none")
        rest_tokens, rest_deltas = run_one(
            engine, prompt, params, output_token_ids=whole_tokens[:k]
        )
        assert whole_tokens[:k] + rest_tokens == whole_tokens
        assert "".join(whole_deltas[:k] + rest_deltas) == "".join(whole_deltas)


def test_repetition_penalty_matches_transformers_generate(loaded, ref):
    """Greedy with repetition_penalty equals transformers' own processor (the same formula over
    prompt and output), near-tie rule; the batch shares no state between rows."""
    engine = make_engine(loaded, kv_cache_memory="16MiB")
    rng = random.Random(11)
    prompts = [random_prompt(rng, rng.randint(4, 20)) for _ in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    got = [r.token_ids for r in engine.generate(prompts, params)]
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        want = ref.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.3,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert tokens == want  # no teacher-forced rule: the penalty is not in the reference
    plain = engine.generate(prompts, greedy(16))
    assert any(r.token_ids != t for r, t in zip(plain, got, strict=True))  # it did something


def test_logit_bias_and_min_tokens_through_the_engine(loaded):
    engine = make_engine(loaded, kv_cache_memory="16MiB")
    forced = SamplingParams(max_tokens=6, temperature=0, logit_bias=((42, 100.0),))
    assert engine.generate([[5, 6, 7]], forced)[0].token_ids == [42] * 6
    # The first greedy token is made a stop token: without min_tokens it ends the request at once.
    first = engine.generate([[5, 6, 7]], greedy(1))[0].token_ids[0]
    stops = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,))
    assert engine.generate([[5, 6, 7]], stops)[0].token_ids == [first]
    held = replace(stops, min_tokens=3)
    result = engine.generate([[5, 6, 7]], held)[0]
    assert len(result.token_ids) >= 3 and first not in result.token_ids[:2]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("x", [5], SamplingParams(logit_bias=((10**6, 1.0),)))


def test_logprobs_are_the_reference_models_next_token_log_probs(loaded, ref):
    """Each sampled token's log-prob and alternatives, against transformers' own forward over
    the same tokens (teacher-forced), under continuous batching of two requests."""
    engine = make_engine(loaded, kv_cache_memory="16MiB")
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    for prompt, result in zip(prompts, engine.generate(prompts, params), strict=True):
        assert len(result.logprobs) == 6
        rows = next_token_logprobs(ref, prompt + result.token_ids[:-1])[len(prompt) - 1 :]
        for j, (token, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
            assert lp.logprob == pytest.approx(float(rows[j, token]), abs=1e-4)
            assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy: the likeliest
            assert [v for _, v in lp.top] == pytest.approx(
                rows[j].topk(3).values.tolist(), abs=1e-4
            )
    plain = engine.generate(prompts, greedy(6))
    assert all(r.logprobs == [] for r in plain)  # nobody asked: nothing computed
