"""Speculative decoding with a draft model (engine/draft_model.py): the target's tokens whatever
the draft proposes, the draft's own pool consistent with the target after every step (and empty
once sequences leave: finished, preempted, aborted), and start-up refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.draft_model import DraftModelError
from engine.models.model_loader import LoadedModel, load_model
from generation.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine
from tests.engine.speculation_helpers import GREEDY, PROMPTS, both, check_pools, run
from tests.model_dirs import write_random_llama

SELF = {"speculative_model": "tiny-random", "speculative_max_step_tokens": 64}


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A smaller random Llama with tiny-random's tokenizer: its proposals are mostly wrong."""
    path = tmp_path_factory.mktemp("models") / "draft"
    write_random_llama(
        path,
        seed=1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return str(path)


def test_the_target_as_its_own_draft_is_accepted_almost_always(loaded: LoadedModel):
    """The strongest check of the draft's K/V: proposing with the target's own weights, the
    drafts are the target's greedy picks unless the draft's cache went out of step with the
    target's tokens (a draft kept past a rejection, a catch-up token missed)."""
    plain, spec, engine = both(loaded, [(p, GREEDY) for p in PROMPTS], **SELF)
    assert spec == plain
    stats = engine.stats
    assert stats.num_draft_tokens_total >= 60
    assert stats.num_accepted_tokens_total >= 0.95 * stats.num_draft_tokens_total
    assert engine.drafter is not None and engine.drafter.kv.num_used_blocks == 0


def _greedy(model: torch.nn.Module, tokens: list[int], k: int) -> tuple[list[int], bool]:
    """`model`'s own k greedy picks after `tokens`, from scratch (transformers' attention), and
    whether the last was a near-tie (where another kernel's rounding may pick otherwise)."""
    picks: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            top = model(torch.tensor([tokens + picks])).logits[0, -1].topk(2)
            picks.append(int(top.indices[0]))
            if top.values[0] - top.values[1] < 1e-3:
                return picks, True
    return picks, False


def test_the_draft_proposes_its_own_greedy_continuation_of_the_target_s_tokens(
    loaded: LoadedModel,
):
    """The draft's cache follows the target's tokens through rejected verifications, a pause
    while the batch is too large to speculate (the target decodes past stale proposals) and the
    catch-ups after: each round's proposals are the draft model's own greedy picks after the
    target's tokens, as if computed from scratch. (The target as its own draft samples here, so
    that its draws reject the greedy drafts.)"""
    model = load_model("tiny-random").model  # the same weights, on transformers' attention
    engine = make_engine(
        loaded,
        kv_cache_memory="16MiB",
        speculative_model="tiny-random",
        speculative_max_step_tokens=3,
    )
    params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=1.0, seed=7)
    engine.add_request("a", PROMPTS[0], params)
    seq = engine.policy.seqs["a"]
    checked = paused = 0
    for step in range(80):
        # Three running from "a"'s first verification on: no rows to spare, so "a" decodes
        # plainly past its rejected proposals until the others end.
        if step == 1:
            for rid in ("b", "c"):
                engine.add_request(rid, PROMPTS[1], SamplingParams(max_tokens=6, temperature=0))
        if not engine.has_unfinished():
            break
        before = seq.token_ids(0, seq.num_tokens)
        engine.step()
        check_pools(engine)
        assert engine.drafter is not None
        proposed = engine.drafter.propose(seq, 99).tokens  # this step's, made from `before`
        paused += step > 1 and not proposed and len(engine.policy.running) == 3
        if proposed:
            want, tie = _greedy(model, before, len(proposed))
            assert proposed[: len(want) - tie] == want[: len(want) - tie], (step, before)
            checked += 1
    # (Fewer checks than steps: besides the rows, the model's drafts stop paying for their rows
    # once their measured odds fall, but for a probe now and then.)
    assert checked >= 5 and paused >= 3
    assert seq.num_output_tokens == 50


def test_seeded_sampled_rows_keep_plain_sampling_s_draws(loaded: LoadedModel):
    """A draft model's proposal is a point mass: kept while the target's seeded draw at its
    position is it (rejection sampling), so each seed's tokens are plain sampling's."""
    params = [
        SamplingParams(max_tokens=24, temperature=0.6, top_k=5, seed=seed, ignore_eos=True)
        for seed in range(8)
    ]
    plain, spec, engine = both(loaded, [(PROMPTS[0], p) for p in params], **SELF)
    assert spec == plain
    assert engine.stats.num_accepted_tokens_total > 0


def test_a_smaller_draft_changes_no_token_of_any_kind_of_request(
    loaded: LoadedModel, small_draft: str
):
    """Mostly rejected proposals beside greedy, seeded, n=2, log-prob and penalised rows; a
    small step budget makes the draft catch its prompts up over several steps."""
    requests = [
        (PROMPTS[0], GREEDY),
        (PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=30, temperature=0, n=2, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=30, temperature=0, logprobs=2, ignore_eos=True)),
        (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, frequency_penalty=0.4)),
    ]
    config = {"speculative_model": small_draft, "speculative_max_step_tokens": 64}
    plain, spec, engine = both(loaded, requests, max_num_batched_tokens=24, **config)
    assert spec == plain
    assert engine.stats.num_verifications_total > 0
    assert engine.drafter is not None and engine.drafter.name == "draft"


def test_preempted_and_aborted_sequences_give_their_draft_blocks_back(loaded: LoadedModel):
    """A KV pool too small for six sequences: they are preempted (their mirrors go, caught up
    again from the prompt when they come back); the first two seen mid-speculation are aborted.
    The others' tokens are plain decoding's; the draft pool is empty at the end."""
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    requests = [(p, params) for p in PROMPTS * 2]
    config = {"max_model_len": 128, "kv_cache_memory": "160KiB"}
    plain = run(make_engine(loaded, **config), requests)
    engine = make_engine(loaded, **config, **SELF)
    drafter = engine.drafter
    assert drafter is not None
    for i, (prompt, p) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, p)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    aborted: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        check_pools(engine)
        if not aborted and len(drafter.seqs) >= 2:  # two mirrors mid-speculation
            aborted = sorted(drafter.seqs)[:2]
            for request_id in aborted:
                engine.abort(request_id)
            check_pools(engine)
            assert not set(aborted) & set(drafter.seqs)
    assert len(aborted) == 2
    for request_id in tokens.keys() - set(aborted):
        assert tokens[request_id] == plain[request_id][0][0][1]
    assert engine.stats.num_preemptions_total > 0 and engine.stats.num_accepted_tokens_total > 0
    assert drafter.kv.num_used_blocks == 0


def test_a_draft_pool_too_small_for_every_sequence_still_gives_the_target_s_tokens(
    loaded: LoadedModel,
):
    """Room for about one mirror (3 blocks of 16): the others propose nothing or take the
    room of mirrors whose sequences do not speculate this step."""
    config = {**SELF, "speculative_kv_cache_memory": str(3 * 16 * 512)}  # 512 B per token
    plain, spec, engine = both(loaded, [(p, GREEDY) for p in PROMPTS], **config)
    assert spec == plain
    assert engine.drafter is not None and engine.drafter.kv.num_blocks == 3
    assert engine.stats.num_accepted_tokens_total > 0


def test_start_up_refuses_a_draft_that_cannot_serve_the_target(loaded: LoadedModel, tmp_path: Path):
    from engine.models.tiny_model import build_tiny_tokenizer

    other = build_tiny_tokenizer()
    other.add_tokens(["<|tool|>"])
    path = write_random_llama(tmp_path / "other", hidden_size=32, num_hidden_layers=1)
    other.save_pretrained(path)  # the model's vocabulary stays; its tokenizer has one more
    with pytest.raises(DraftModelError, match="does not share the tokenizer of 'tiny-random'"):
        make_engine(loaded, speculative_model=str(path))
    with pytest.raises(ValueError, match="cannot go with --speculative ngram"):
        make_engine(loaded, speculative_model="tiny-random", speculative="ngram")
    with pytest.raises(ValueError, match="continuous batching only"):
        make_engine(loaded, speculative_model="tiny-random", batching="static")
    with pytest.raises(DraftModelError, match="holds no block"):
        make_engine(loaded, speculative_model="tiny-random", speculative_kv_cache_memory="1KiB")
    with pytest.raises(ValueError, match="leaves nothing of the KV budget"):
        make_engine(
            loaded,
            kv_cache_memory="16MiB",
            speculative_model="tiny-random",
            speculative_kv_cache_memory="16MiB",
        )


def test_the_draft_model_does_not_propose_past_disable_by_batch_size(loaded: LoadedModel):
    """With more sequences running than the cut-off the draft model spends no pass on drafts
    nobody may verify; once few enough are left it proposes again."""
    engine = make_engine(
        loaded, kv_cache_memory="16MiB", speculative_disable_by_batch_size=1, **SELF
    )
    engine.add_request("long", PROMPTS[0], GREEDY)
    engine.add_request("short", PROMPTS[1], SamplingParams(max_tokens=5, temperature=0))
    proposed_by_running: dict[int, int] = {}
    while engine.has_unfinished():
        running = list(engine.policy.running)
        engine.step()
        check_pools(engine)
        assert engine.drafter is not None
        made = sum(len(engine.drafter.propose(seq, 99)) for seq in running)
        proposed_by_running[len(running)] = proposed_by_running.get(len(running), 0) + made
    assert proposed_by_running[2] == 0 and proposed_by_running[1] > 0
