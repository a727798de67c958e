"""The speculation ceiling's replay: steps counted as a verification keeps them."""

from research.speculation_ceiling import (
    Lookup,
    speedup_bound,
    steps_to_decode,
    tokens_per_step,
    with_history,
)


def test_an_output_that_quotes_its_prompt_takes_one_step_per_drafts_and_token():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    # tail (1, 2) was followed by 3..9: all 7 drafts kept and the token after them (10)
    output = [3, 4, 5, 6, 7, 8, 9, 10]
    assert steps_to_decode(prompt, output, Lookup(num_drafts=7)) == 1
    assert steps_to_decode(prompt, output, Lookup(num_drafts=3)) == 2  # 3 + 1, then 3 + 1


def test_text_that_never_repeats_takes_a_step_per_token():
    assert steps_to_decode([1, 2, 3], [4, 5, 6, 7], Lookup()) == 4
    assert tokens_per_step([([1, 2, 3], [4, 5, 6, 7])], Lookup()) == 1.0


def test_more_candidates_keep_the_longest_match():
    # (7, 8) occurs twice: the latest match continues with 1, the earlier one with 2, 3, 4
    prompt = [7, 8, 2, 3, 4, 0, 7, 8, 1, 0, 7, 8]
    output = [2, 3, 4, 5]
    one = Lookup(num_drafts=3, candidates=1)
    assert one.continuations(prompt) == [[1, 0, 7]]
    # 1 is refused: the step keeps 2 alone; then (8, 2) continues 3, 4: kept, and 5 after them
    assert steps_to_decode(prompt, output, one) == 2
    two = Lookup(num_drafts=3, candidates=2)
    assert two.continuations(prompt)[1] == [2, 3, 4]
    assert steps_to_decode(prompt, output, two) == 1  # 2, 3, 4 kept and 5 after them


def test_the_speed_up_bound_pays_for_the_kept_drafts_only():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    output = [3, 4, 5, 6, 7, 8, 9, 10]  # one step: 7 drafts kept and the token after them
    lookup = Lookup(num_drafts=7)
    assert speedup_bound([(prompt, output)], lookup, 0.0) == 8.0
    assert speedup_bound([(prompt, output)], lookup, 0.5) == 8 / (1 + 0.5 * 7)
    # Nothing repeats: plain decoding's speed, whatever drafts would cost.
    assert speedup_bound([([1, 2, 3], [4, 5, 6, 7])], lookup, 0.3) == 1.0


def test_a_reply_that_another_one_repeats_is_drafted_from_it_with_the_history():
    # b's reply is a's: from its own text nothing repeats; with a's reply, after three single
    # steps (the history looks up 3 tokens at least), 7 kept and one more, twice, then the last.
    a = ([1, 2], list(range(100, 120)))
    b = ([3, 4], list(range(100, 120)))
    short = ([5], [6, 7, 8])
    lines = with_history([a, b, short], num_drafts=7, longest=2)
    for line in lines:  # 20 tokens in 6 steps; the last 40%: 8 + 1 tokens in 2
        assert line.split() == ["20", "1.00", "1.00", "|", "3.33", "4.50"]
