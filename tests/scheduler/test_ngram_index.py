"""Prompt lookup through a sequence's NgramIndex gives exactly the drafts of a scan back
through its text, at every length the text grows through, for every lookup setting."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Sequence
from scheduler.speculation import NgramProposer, OutputHistory
from scheduler.speculation.ngram_index import NONE, NgramIndex

SETTINGS = [
    (4, 2, True),
    (4, 2, False),
    (4, 1, True),
    (3, 1, False),
    (5, 3, True),
    (1, 1, True),
    (2, 2, True),
]


def grow_and_compare(proposer: NgramProposer, prompt: list[int], growth: list[list[int]]) -> int:
    """Grow a sequence by each chunk of `growth` (a step's kept drafts and sampled token),
    checking after each that the indexed proposal is the scan's. Returns the proposals made."""
    seq = Sequence.create("s", prompt, max_tokens=10**6)
    made = 0
    for chunk in growth:
        for token in chunk:
            seq.append_token(token)
        for k in (1, 3, 7):
            text = seq.token_ids(0, seq.num_tokens)
            indexed, scanned = proposer.propose(seq, k), proposer.follow(text, k)
            assert indexed == scanned, (text, k, indexed, scanned)
            made += bool(indexed.tokens)
    return made


@pytest.mark.parametrize(("longest", "shortest", "resume"), SETTINGS)
def test_indexed_lookups_are_the_scans_on_repetitive_texts(longest, shortest, resume):
    rng = random.Random(longest * 100 + shortest * 10 + resume)
    proposer = NgramProposer(longest, shortest, resume=resume)
    made = 0
    for _ in range(20):
        vocab = rng.randint(2, 6)  # few symbols: many matches, many repeated n-grams
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        growth = [[rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for _ in range(40)]
        made += grow_and_compare(proposer, prompt, growth)
    assert made > 100  # the comparison saw real proposals, not only empty ones


def test_indexed_lookups_are_the_scans_with_a_history_of_earlier_replies():
    rng = random.Random(7)
    history = OutputHistory(capacity=10_000)
    for _ in range(20):
        history.add([rng.randrange(5) for _ in range(40)])
    proposer = NgramProposer(4, 2, history)
    prompt = [rng.randrange(50) for _ in range(30)]  # unlike the history: its lookups too
    growth = [[rng.randrange(5)] for _ in range(200)]
    assert grow_and_compare(proposer, prompt, growth) > 100


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=25),
    growth=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=25),
    setting=st.sampled_from(SETTINGS),
)
def test_indexed_lookups_are_the_scans_for_any_text(prompt, growth, setting):
    longest, shortest, resume = setting
    grow_and_compare(NgramProposer(longest, shortest, resume=resume), prompt, growth)


def test_a_changed_setting_rebuilds_the_sequence_s_index():
    seq = Sequence.create("s", [1, 2, 3, 4, 1, 2, 3], max_tokens=10)
    assert NgramProposer(3, 2).propose(seq, 2).tokens == [4, 1]
    index = seq.speculation.lookup_index
    assert index is not None and index.sizes == (2, 3)
    assert NgramProposer(3, 1).propose(seq, 2).tokens == [4, 1]
    assert seq.speculation.lookup_index is not index and seq.speculation.lookup_index.sizes == (
        1,
        2,
        3,
    )


def test_the_index_keeps_the_latest_start_and_the_one_before():
    index = NgramIndex((2,))
    text = [5, 6, 5, 6, 5, 6, 9]
    index.extend(text, 0, len(text))
    # The 2-grams of the text but its last token: "5 6" at 0, 2 and 4.
    assert index.start_before((5, 6), 5) == 4
    assert index.start_before((5, 6), 4) == 2
    assert index.start_before((6, 9), 6) == NONE  # ends at the last token: not indexed yet
    assert index.first_needed() == 5  # one token more: read from the new n-grams' starts
    index.extend([6, 9, 7], 5, 8)
    assert index.start_before((6, 9), 6) == 5
    assert index.start_before((6, 9), 5) == NONE
    with pytest.raises(AssertionError, match="from position 6"):
        index.extend([7, 1], 7, 9)  # too short a view to index the new n-grams
