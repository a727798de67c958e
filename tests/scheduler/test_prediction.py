"""Predicted outputs in the scheduler: drafts follow the reply through the caller's prediction,
find it again after an edit, and come before prompt lookup's, under kinds of their own."""

from __future__ import annotations

from scheduler import Sequence
from scheduler.speculation import NgramProposer
from scheduler.speculation.ngram import is_resume_kind
from scheduler.speculation.prediction import (
    Prediction,
    is_prediction_kind,
    prediction_kind,
)

LOOKUPS = NgramProposer().lookups()  # (4, 0), (3, 0), (2, 0), then resumed (4, 1) ..
PREDICTED = tuple(range(100, 130))


def propose(prediction: Prediction, output: list[int], k: int = 4):
    return prediction.propose(output, k, LOOKUPS)


def walk(prediction: Prediction, output: list[int], k: int = 4):
    """The proposal after `output`, proposed after each of its tokens as the engine does."""
    for end in range(1, len(output)):
        propose(prediction, output[:end], k)
    return propose(prediction, output, k)


def test_a_reply_in_step_gets_what_comes_next_in_the_prediction():
    p = Prediction(PREDICTED)
    assert propose(p, [100]).tokens == [101, 102, 103, 104]
    assert propose(p, [100]).kind == prediction_kind()
    assert propose(p, [100, 101, 102]).tokens == [103, 104, 105, 106]  # two kept since
    assert propose(p, list(PREDICTED[:28]), 7).tokens == [128, 129]  # up to its end
    assert propose(p, list(PREDICTED)).tokens == []  # nothing after its last token


def test_a_reply_that_starts_elsewhere_gets_nothing_until_its_tail_is_found():
    p = Prediction(PREDICTED)
    assert propose(p, [7]).tokens == []  # one token of its own: no tail of 2 yet
    found = propose(p, [7, 110, 111])
    assert found.tokens == [112, 113, 114, 115] and found.kind == prediction_kind(2)
    # Found again, it is in step from there.
    assert propose(p, [7, 110, 111, 112]).kind == prediction_kind()


def test_an_edit_is_taken_up_again_after_the_replaced_token():
    p = Prediction(PREDICTED)
    output = [100, 101, 102, 103, 999]  # 104 replaced
    proposal = propose(p, output)
    assert proposal.tokens == [105, 106, 107, 108]
    assert proposal.kind == prediction_kind(4, skip=1)


def test_an_insertion_and_a_deletion_are_followed():
    p = Prediction(PREDICTED)
    assert propose(p, [100, 101]).tokens == [102, 103, 104, 105]
    inserted = [100, 101, 7, 8, 9, 102, 103]  # three tokens of its own, then the prediction
    assert propose(p, inserted).tokens == [104, 105, 106, 107]
    deleted = [*inserted, 112, 113]  # 104-111 left out
    assert propose(p, deleted).tokens == [114, 115, 116, 117]


def test_a_repeated_span_is_found_where_the_reply_stands_not_behind_it():
    # "1 2" occurs three times; the reply, past the first, continues at the next one.
    p = Prediction((1, 2, 30, 1, 2, 40, 1, 2, 50))
    assert walk(p, [1, 2, 30, 9, 9, 1, 2]).tokens == [40, 1, 2, 50]
    # A reply never seen in it before: the first occurrence.
    assert propose(Prediction(p.tokens), [9, 9, 1, 2]).tokens == [30, 1, 2, 40]
    # Past every occurrence: the last one.
    assert walk(p, [1, 2, 30, 1, 2, 40, 1, 2, 50, 8, 8, 1, 2]).tokens == [50]


def test_the_proposer_drafts_from_a_prediction_first_and_falls_back_to_prompt_lookup():
    seq = Sequence.create("s", [1, 2, 3, 4, 1, 2, 3], max_tokens=50)
    proposer = NgramProposer(4, 2)
    assert proposer.propose(seq, 3).tokens == [4, 1, 2]  # prompt lookup: no prediction
    seq.speculation.prediction = Prediction((50, 51, 52, 53))
    seq.append_token(50)
    predicted = proposer.propose(seq, 3)
    assert predicted.tokens == [51, 52, 53] and is_prediction_kind(predicted.kind)
    for token in (51, 1, 2):  # off the prediction: prompt lookup again ("1 2" -> "3 50 51")
        seq.append_token(token)
    fallback = proposer.propose(seq, 3)
    assert fallback.tokens == [3, 50, 51] and not is_prediction_kind(fallback.kind)


def test_prediction_kinds_are_neither_lookups_nor_resumed_copies():
    for kind in (prediction_kind(), prediction_kind(3), prediction_kind(2, skip=1)):
        assert is_prediction_kind(kind) and not is_resume_kind(kind)
    assert len({prediction_kind(), prediction_kind(2), prediction_kind(2, skip=1)}) == 3


class CountingOutput(list):
    """A reply that counts the tokens read through slices of it."""

    read = 0

    def __getitem__(self, index):
        items = super().__getitem__(index)
        if isinstance(index, slice):
            CountingOutput.read += len(items)
        return items


def test_a_reply_that_left_the_prediction_for_good_is_not_compared_again_and_again():
    # Once the tokens since the last sync point differ from the prediction's, they always will:
    # a step must not compare a slice that grows with the reply.
    p = Prediction(PREDICTED)
    output = CountingOutput([100, 101, 102])
    assert propose(p, output).kind == prediction_kind()
    reads = []
    for token in range(1000, 1200):  # a reply of its own from here, nowhere in the prediction
        output.append(token)
        CountingOutput.read = 0
        proposal = propose(p, output)
        reads.append(CountingOutput.read)
        if token > 1000:  # (1000 is taken for an edit of 103: resumed past it)
            assert proposal.tokens == []
    tails = sum(n for n, _ in LOOKUPS)  # each tail looked up, not the 200 tokens since
    assert max(reads[10:]) <= tails, reads
