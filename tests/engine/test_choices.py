"""n > 1: the choices of one request share its prompt's KV blocks (computed once, then found
in the prefix cache), sample their own streams, and end, abort and resume one by one."""

from dataclasses import replace

import pytest

from generation import SamplingParams
from tests.engine.engine_helpers import make_engine

PROMPT = list(range(5, 47))  # 42 tokens: 10 full blocks of 4 and a partial one


def run(engine, outputs=()):
    """Step until idle; each choice's tokens and final output by index (`outputs`: of steps
    the test ran itself)."""
    tokens: dict[int, list[int]] = {}
    finals = {}
    while True:
        for out in outputs:
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.index] = out
        if not engine.has_unfinished():
            return tokens, finals
        outputs = engine.step()


def test_greedy_choices_are_identical_and_the_prompt_blocks_are_allocated_once(loaded):
    engine = make_engine(loaded, block_size=4, max_num_seqs=8)
    bm = engine.block_manager
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=4)
    engine.add_request("r", PROMPT, params)
    outputs = engine.step()  # choice 0 prefills the prompt alone and samples its first token
    assert engine.view.num_running == 1 and engine.view.num_waiting == 3
    outputs += engine.step()  # the other three join: their full prompt blocks are choice 0's
    tables = [bm.block_table(seq_id) for seq_id in engine.choices.by_request["r"]]
    assert len(tables) == 4
    shared = tables[0][: len(PROMPT) // 4]
    assert all(t[: len(shared)] == shared for t in tables)
    assert all(bm.blocks[b].ref_count == 4 for b in shared)
    # Allocated once: 10 shared blocks + one partial/decode block per choice.
    assert bm.num_used_blocks == len(shared) + 4 * (len(tables[0]) - len(shared))
    tokens, finals = run(engine, outputs)
    assert sorted(tokens) == [0, 1, 2, 3]
    assert all(tokens[i] == tokens[0] and len(tokens[i]) == 8 for i in tokens)
    assert all(f.finish_reason == "length" and f.num_output_tokens == 8 for f in finals.values())
    assert bm.num_used_blocks == 0 and not engine.choices.by_request
    bm.check_integrity()


def test_sampled_choices_differ_and_a_seed_repeats_them_all(loaded):
    engine = make_engine(loaded, max_num_seqs=8)
    params = SamplingParams(max_tokens=12, seed=3, ignore_eos=True, n=3)
    engine.add_request("a", PROMPT, params)
    first, _ = run(engine)
    engine.add_request("b", PROMPT, params)
    again, _ = run(engine)
    assert first == again
    assert len({tuple(t) for t in first.values()}) == 3
    # Choice 0 is the request alone: n does not change what a seed draws for it.
    engine.add_request("c", PROMPT, replace(params, n=1))
    alone, _ = run(engine)
    assert alone[0] == first[0]


def test_one_choice_aborted_the_others_go_on(loaded):
    engine = make_engine(loaded, max_num_seqs=8)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=20, seed=1, ignore_eos=True, n=3))
    [held] = engine.abort("r", index=2)  # still held back behind choice 0
    assert held.index == 2 and held.finish_reason == "abort"
    engine.step()
    [running] = engine.abort("r", index=0)
    assert running.index == 0 and running.finish_reason == "abort"
    _, finals = run(engine)
    assert list(finals) == [1] and finals[1].finish_reason == "length"
    assert engine.view.kv_used_blocks == 0 and not engine.choices.by_request


def test_aborting_the_request_ends_every_choice(loaded):
    engine = make_engine(loaded, max_num_seqs=8)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=20, n=3))
    engine.step()
    finals = engine.abort("r")
    assert sorted(f.index for f in finals) == [0, 1, 2]
    assert not engine.has_unfinished() and engine.view.kv_used_blocks == 0


def test_a_taken_over_request_resumes_only_its_unfinished_choices(loaded):
    engine = make_engine(loaded, max_num_seqs=8)
    params = SamplingParams(max_tokens=10, seed=5, ignore_eos=True, n=3)
    engine.add_request("whole", PROMPT, params)
    whole, _ = run(engine)
    # Choice 1 had finished; choice 0 had 4 tokens delivered, choice 2 none.
    engine.add_request("r", PROMPT, params, output_token_ids={0: whole[0][:4], 2: []})
    tokens, finals = run(engine)
    assert sorted(finals) == [0, 2]
    assert whole[0][:4] + tokens[0] == whole[0] and tokens[2] == whole[2]
    with pytest.raises(ValueError, match="do not fit"):
        engine.add_request("bad", PROMPT, params, output_token_ids={3: []})


def test_choices_under_preemption_finish_with_their_own_tokens(loaded):
    """A pool too small for all choices at once: they preempt each other and still match a
    run with room for all."""
    params = SamplingParams(max_tokens=24, seed=9, ignore_eos=True, n=4)
    roomy = make_engine(loaded, block_size=4, max_num_seqs=8)
    roomy.add_request("r", PROMPT, params)
    want, _ = run(roomy)
    tight = make_engine(loaded, block_size=4, kv_cache_memory=str(30 * 2048), max_num_seqs=8)
    tight.add_request("r", PROMPT, params)
    got, _ = run(tight)
    assert tight.stats.num_preemptions_total > 0
    assert got == want
