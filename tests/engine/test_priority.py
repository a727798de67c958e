"""Request priority through the engine on the tiny model: an urgent request preempts a less urgent
one for a slot, starts at the next step, and every output keeps greedy parity."""

import random

from generation import SamplingParams
from tests.engine.engine_helpers import assert_greedy_parity, make_engine, reference_greedy


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_urgent_request_preempts_a_slot_and_every_output_keeps_parity(loaded, ref):
    """Two priority-9 requests hold both slots; a priority-0 one added mid-run is scheduled in the
    very next step (its first token with it) by preempting the newer priority-9 one, which is
    recomputed later. All three match transformers' greedy output alone."""
    rng = random.Random(11)
    prompts = {name: [rng.randrange(3, 280) for _ in range(12)] for name in ("lo0", "lo1", "hi")}
    lengths = {"lo0": 12, "lo1": 12, "hi": 6}
    engine = make_engine(loaded, max_num_seqs=2, kv_cache_memory="8MiB")
    for name in ("lo0", "lo1"):
        engine.add_request(name, prompts[name], greedy(lengths[name]), priority=9)
    tokens: dict[str, list[int]] = {name: [] for name in prompts}

    def step() -> set[str]:
        outs = engine.step()
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
        return {out.request_id for out in outs if out.new_token_ids}

    for _ in range(3):
        step()
    engine.add_request("hi", prompts["hi"], greedy(lengths["hi"]), priority=0)
    assert engine.choices.by_seq["hi"].seq.priority == 0
    produced = step()
    assert "hi" in produced and engine.view.first_scheduled_time("hi") is not None
    assert engine.choices.by_seq["lo1"].seq.num_preemptions == 1  # the newer of the two
    assert engine.choices.by_seq["lo0"].seq.num_preemptions == 0
    assert engine.stats.num_preemptions_total == 1
    while engine.has_unfinished():
        step()
    engine.block_manager.check_integrity()
    assert engine.view.kv_used_blocks == 0
    for name, prompt in prompts.items():
        assert len(tokens[name]) == lengths[name]
        want = reference_greedy(ref, prompt, lengths[name])
        assert_greedy_parity(ref, prompt, tokens[name], want)


def test_every_choice_carries_the_priority(loaded):
    engine = make_engine(loaded, kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=2, temperature=0.5, seed=1, n=3, ignore_eos=True)
    engine.add_request("r", [5, 6, 7, 8], params, priority=-3)
    choices = engine.choices
    assert [choices.by_seq[i].seq.priority for i in choices.by_request["r"]] == [-3, -3, -3]
