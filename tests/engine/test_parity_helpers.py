"""The parity helpers themselves: a divergence at a near-tie is accepted, and every token after
it is still checked teacher-forced, so a wrong token after the tie fails.

The near-tie is placed by hand: token B's output row is made a copy of token A's, so wherever A
is the argmax, B ties it exactly.
"""

import re
import string
from dataclasses import dataclass

import pytest
import torch

from engine.models.model_loader import LoadedModel, load_model
from engine.outputs import CompletedRequest
from tests.engine.engine_helpers import (
    assert_greedy_parity,
    next_token_logprobs,
    reference_greedy,
)
from tests.service.helpers import assert_same_greedy_text, streamed_text

PROMPT = [5, 6, 7, 8, 9, 10]
LENGTH = 16


@dataclass
class Tie:
    ref: LoadedModel
    want: list[int]  # the reference's greedy output
    got: list[int]  # takes the other tied token at `at`, then greedy from there
    at: int


@pytest.fixture(scope="module")
def tie() -> Tie:
    ref = load_model("tiny-random")
    a = reference_greedy(ref, PROMPT, LENGTH)[2]
    b = 3 + ord("Z") if a != 3 + ord("Z") else 3 + ord("Q")  # a byte token whose text differs
    with torch.no_grad():
        ref.model.lm_head.weight[b] = ref.model.lm_head.weight[a]
    want = reference_greedy(ref, PROMPT, LENGTH)
    at = next(i for i, token in enumerate(want) if token in (a, b))
    other = b if want[at] == a else a
    prefix = [*want[:at], other]
    got = prefix + reference_greedy(ref, PROMPT + prefix, LENGTH - len(prefix))
    # The continuation after the tie differs too: the check must judge it, not compare it.
    assert got[at + 1 :] != want[at + 1 :]
    return Tie(ref, want, got, at)


LETTERS = [3 + ord(c) for c in string.ascii_letters]  # byte tokens: their text always shows


def corrupt(tie: Tie, position: int) -> list[int]:
    """`tie.got` with its token at `position` replaced by the least likely letter there (not
    any token: stray bytes all read as U+FFFD, so swapping one for another is not seen)."""
    row = next_token_logprobs(tie.ref, PROMPT + tie.got[:position])[-1]
    letter = LETTERS[int(row[LETTERS].argmin())]
    return [*tie.got[:position], letter, *tie.got[position + 1 :]]


def test_a_divergence_at_a_near_tie_is_followed_teacher_forced(tie: Tie) -> None:
    assert_greedy_parity(tie.ref, PROMPT, tie.got, tie.want)
    assert_greedy_parity(tie.ref, PROMPT, tie.want, tie.want)


@pytest.mark.parametrize("after", [1, 3, LENGTH])
def test_a_wrong_token_after_the_near_tie_fails(tie: Tie, after: int) -> None:
    position = min(tie.at + after, LENGTH - 1)
    with pytest.raises(AssertionError, match=rf"^token {position}: got \d+, .* no near-tie"):
        assert_greedy_parity(tie.ref, PROMPT, corrupt(tie, position), tie.want)


def test_a_wrong_token_before_any_tie_fails(tie: Tie) -> None:
    with pytest.raises(AssertionError, match=r"^token 0: "):
        assert_greedy_parity(tie.ref, PROMPT, corrupt(tie, 0), tie.want)


def offline(tie: Tie) -> CompletedRequest:
    text = streamed_text(tie.ref.tokenizer, PROMPT, tie.want)
    return CompletedRequest("r", PROMPT, tie.want, text)


def test_served_text_that_parts_at_a_near_tie_is_followed_to_its_end(tie: Tie) -> None:
    served = streamed_text(tie.ref.tokenizer, PROMPT, tie.got)
    assert served != offline(tie).text
    assert_same_greedy_text(tie.ref, PROMPT, served, offline(tie))


@pytest.mark.parametrize("after", [2, LENGTH])
def test_served_text_with_a_wrong_token_after_the_near_tie_fails(tie: Tie, after: int) -> None:
    position = min(tie.at + after, LENGTH - 1)
    served = streamed_text(tie.ref.tokenizer, PROMPT, corrupt(tie, position))
    with pytest.raises(AssertionError, match=r"no near-tie .* fits at token (\d+):") as failed:
        assert_same_greedy_text(tie.ref, PROMPT, served, offline(tie))
    # Held-back bytes may carry the walk a few tokens further, never short of the wrong one.
    assert int(re.search(r"fits at token (\d+)", str(failed.value))[1]) >= position


def test_served_text_one_token_short_fails(tie: Tie) -> None:
    served = streamed_text(tie.ref.tokenizer, PROMPT, tie.got[:-1])
    with pytest.raises(AssertionError, match="served"):
        assert_same_greedy_text(tie.ref, PROMPT, served, offline(tie))
