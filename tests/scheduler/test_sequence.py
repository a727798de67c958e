"""The sequence state machine and its token bookkeeping."""

import pytest

from scheduler import Sequence, SequenceStatus
from scheduler.sequence import IllegalTransitionError

S = SequenceStatus


def test_finished_states_are_above_preempted():
    """is_finished is exactly the terminal states, each with its OpenAI finish reason."""
    assert [s for s in S if s.is_finished] == [
        S.FINISHED_STOPPED,
        S.FINISHED_LENGTH,
        S.FINISHED_ABORTED,
    ]
    assert [s.finish_reason for s in S if s.is_finished] == ["stop", "length", "abort"]


def test_legal_path_waiting_running_preempted_running_finished():
    """The documented lifecycle moves through set_status without error."""
    seq = Sequence.create("a", [1, 2, 3], max_tokens=2)
    for status in (S.RUNNING, S.PREEMPTED, S.RUNNING, S.FINISHED_LENGTH):
        seq.set_status(status)
    assert seq.status is S.FINISHED_LENGTH


@pytest.mark.parametrize(
    ("start", "target"),
    [
        (S.WAITING, S.FINISHED_LENGTH),  # must run before it can finish
        (S.WAITING, S.PREEMPTED),
        (S.FINISHED_STOPPED, S.RUNNING),  # terminal is terminal
        (S.FINISHED_ABORTED, S.FINISHED_ABORTED),
        (S.PREEMPTED, S.FINISHED_STOPPED),
    ],
)
def test_illegal_transitions_raise(start, target):
    """Any move outside the transition table is refused."""
    seq = Sequence.create("a", [1], max_tokens=1)
    seq.status = start
    with pytest.raises(IllegalTransitionError):
        seq.set_status(target)


def test_token_ids_span_prompt_and_output():
    """token_ids(start, stop) reads positions across the prompt/output boundary."""
    seq = Sequence.create("a", [10, 11, 12], max_tokens=5)
    for t in (20, 21):
        seq.append_token(t)
    assert seq.num_tokens == 5
    assert seq.token_ids(0, 5) == [10, 11, 12, 20, 21]
    assert seq.token_ids(2, 4) == [12, 20]
    assert seq.token_ids(3, 5) == [20, 21]
    assert seq.token_ids(0, 2) == [10, 11]


def test_append_token_reports_length_and_stop():
    """max_tokens gives FINISHED_LENGTH, a stop token id FINISHED_STOPPED (stop wins)."""
    seq = Sequence.create("a", [1], max_tokens=3, stop_token_ids=[99])
    assert seq.append_token(5) is None
    assert seq.append_token(99) is S.FINISHED_STOPPED
    seq2 = Sequence.create("b", [1], max_tokens=2, stop_token_ids=[99])
    assert seq2.append_token(5) is None
    assert seq2.append_token(6) is S.FINISHED_LENGTH
    seq3 = Sequence.create("c", [1], max_tokens=1, stop_token_ids=[99])
    assert seq3.append_token(99) is S.FINISHED_STOPPED


def test_max_total_tokens_excludes_last_sample():
    """The last sampled token is never fed back, so it needs no KV slot."""
    assert Sequence.create("a", [1] * 10, max_tokens=6).max_total_tokens == 15


def test_bad_sequences_are_refused():
    """An empty prompt or max_tokens < 1 is a ValueError, not a hang later."""
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence.create("a", [], max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        Sequence.create("a", [1], max_tokens=0)
