"""n > 1, prompt log-probs and grammars through `jitney worker` on a real redis-server: the test
stands in for the gateway (XADD requests, XREAD replies, cancels), and kills a worker holding a
request with choices to check the takeover resumes each choice once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import llguidance
import pytest
import redis

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from generation.sampling_params import SamplingParams
from protocol import (
    STOP_STRING,
    WORKER_GROUP,
    CancelMessage,
    ReplyMessage,
    RequestMessage,
    encode_replies,
)
from tests.service.test_worker_service import KEYS, MODEL, REPLIES, REQUESTS, Replies, pending_ids
from tests.services import RedisServer, Worker, start_worker, wait_for, wait_ready
from worker.intake import HISTORY_LOST_SEQ
from worker.redis_io import published_history, resumed_outputs

PROMPT = list(range(5, 30))


def send(r: redis.Redis, request_id: str, params: SamplingParams, priority: int = 0) -> None:
    msg = RequestMessage(
        request_id, MODEL, PROMPT, params.to_dict(), REPLIES, "test-gw", time.time(), None, priority
    )
    r.xadd(REQUESTS, msg.encode())


def by_choice(replies: list[ReplyMessage]) -> dict[int, list[ReplyMessage]]:
    """One request's replies per choice, after checking seqs run 0, 1, 2, ... without a gap."""
    assert [m.seq for m in replies] == list(range(len(replies)))
    choices: dict[int, list[ReplyMessage]] = {}
    for m in replies:
        assert not choices.get(m.index) or not choices[m.index][-1].is_final  # one final each
        choices.setdefault(m.index, []).append(m)
    return choices


def wait_choices(replies: Replies, request_id: str, n: int, timeout: float = 60) -> None:
    def done() -> bool:
        replies.poll()
        got = replies.by_request.get(request_id, [])
        return sum(m.is_final for m in got) == n

    wait_for(done, timeout, f"{n} finals of {request_id}")


def offline_choices(params: SamplingParams) -> dict[int, list[int]]:
    engine = Engine(EngineConfig(model=MODEL, kv_cache_memory="16MiB"))
    engine.add_request("ref", PROMPT, params)
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    return tokens


def test_a_takeover_resumes_each_unfinished_choice_after_its_published_replies():
    """What a takeover reads back from the reply stream: each choice's delivered tokens; a
    choice with a final is done; duplicates are dropped, and a gap means nothing is resumed."""
    replies = [
        ReplyMessage("r", 0, [1, 2]),
        ReplyMessage("r", 1, [7], index=2),
        ReplyMessage("r", 2, [5], index=1, finish_reason="stop"),
        ReplyMessage("r", 3, [3], index=0),
    ]
    history = published_history([replies[2], *replies, replies[0]])
    assert history == replies
    assert resumed_outputs(history, 3) == {0: [1, 2, 3], 2: [7]}
    assert resumed_outputs([ReplyMessage("s", 0, [1, 2]), ReplyMessage("s", 1, [3])], 1) == [
        1,
        2,
        3,
    ]
    assert published_history(replies[1:]) is None  # seq 0 is gone


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
def worker(server: RedisServer) -> Iterator[Worker]:
    worker = start_worker(server, "wc")
    try:
        wait_ready(server.client(), worker)
        yield worker
    finally:
        worker.proc.stop()


def test_choices_reply_per_index_and_the_entry_is_acked_after_the_last(server, worker):
    r = server.client()
    replies = Replies(r)
    params = SamplingParams(
        max_tokens=12, seed=4, ignore_eos=True, n=3, logprobs=1, prompt_logprobs=2
    )
    send(r, "n3", params)
    wait_choices(replies, "n3", 3)
    choices = by_choice(replies.by_request["n3"])
    assert sorted(choices) == [0, 1, 2]
    want = offline_choices(params)
    for index, got in choices.items():
        final = got[-1]
        assert final.finish_reason == "length" and final.completion_tokens == 12
        assert final.prompt_tokens == len(PROMPT)
        assert [t for m in got for t in m.token_ids] == want[index]
        assert sum(len(m.logprobs or ()) for m in got) == 12
    firsts = [m for m in replies.by_request["n3"] if m.prompt_logprobs is not None]
    assert len(firsts) == 1 and firsts[0].index == 0
    assert len(firsts[0].prompt_logprobs) == len(PROMPT) - 1
    assert all(len(top) == 2 for _, top in firsts[0].prompt_logprobs)
    assert pending_ids(r) == []


def test_a_cancel_with_an_index_ends_that_choice_only(server, worker):
    r = server.client()
    replies = Replies(r)
    send(r, "cut", SamplingParams(max_tokens=400, seed=2, ignore_eos=True, n=2))
    replies.wait_for_tokens("cut", 6)
    r.xadd(KEYS.cancels, CancelMessage("cut", STOP_STRING, index=1).encode())
    wait_choices(replies, "cut", 2)
    choices = by_choice(replies.by_request["cut"])
    assert choices[1][-1].finish_reason == "stop"
    assert choices[1][-1].completion_tokens < 400
    assert choices[0][-1].finish_reason == "length" and choices[0][-1].completion_tokens == 400
    assert pending_ids(r) == []


def test_a_grammar_that_does_not_compile_is_an_error_reply(server, worker):
    r = server.client()
    replies = Replies(r)
    bad = llguidance.LLMatcher.grammar_from_regex("a(b")
    send(r, "bad-grammar", SamplingParams(grammar=bad))
    final = replies.wait("bad-grammar")["bad-grammar"]
    assert final.finish_reason == "error" and "grammar" in (final.error or "")
    assert final.error_type == "invalid_request_error"


def test_a_priority_outside_the_range_is_an_error_reply(server, worker):
    r = server.client()
    replies = Replies(r)
    send(r, "too-urgent", SamplingParams(max_tokens=2), priority=-500)
    final = replies.wait("too-urgent")["too-urgent"]
    assert final.finish_reason == "error" and "priority must be in" in (final.error or "")
    # Unseeded, the sampled reply could end at EOS within its 2 tokens (it did once in CI).
    send(r, "urgent", SamplingParams(max_tokens=2, seed=3, ignore_eos=True), priority=-100)
    assert replies.wait("urgent")["urgent"].finish_reason == "length"


@pytest.mark.slow
def test_a_killed_worker_s_choices_are_resumed_once_each(server):
    """Choice 1 has ended (a stop string); the worker dies mid-generation; another takes the
    request over and resumes choices 0 and 2 after their delivered tokens, not choice 1. The
    request is constrained: the heir's matchers replay the delivered tokens."""
    r = server.client()
    r.delete(REPLIES)
    replies = Replies(r)
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-z ]{120,}")  # no end before 120 letters
    params = SamplingParams(max_tokens=300, seed=6, ignore_eos=True, n=3, grammar=grammar)
    first = start_worker(server, "victim", env={"JITNEY_FAILPOINTS": "step_delay_ms=20"})
    try:
        wait_ready(r, first)
        send(r, "kill", params)
        replies.wait_for_tokens("kill", 30)
        r.xadd(KEYS.cancels, CancelMessage("kill", STOP_STRING, index=1).encode())
        wait_for(
            lambda: replies.poll() or any(m.is_final for m in replies.by_request["kill"]),
            30,
            "choice 1 ended",
        )
        first.proc.proc.kill()
    finally:
        first.proc.stop()
    second = start_worker(server, "heir")
    try:
        wait_ready(r, second)
        wait_choices(replies, "kill", 3, timeout=90)
    finally:
        second.proc.stop()
    choices = by_choice(replies.by_request["kill"])
    want = offline_choices(params)
    ended = [t for m in choices[1] for t in m.token_ids]
    assert choices[1][-1].finish_reason == "stop" and ended == want[1][: len(ended)]
    tokenizer = load_model(MODEL).tokenizer
    for index in (0, 2):
        got = [t for m in choices[index] for t in m.token_ids]
        assert got == want[index] and len(got) > 30
        text = tokenizer.decode(got, skip_special_tokens=True)  # the grammar may end at EOS
        assert set(text) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert pending_ids(r) == []


def test_a_takeover_whose_reply_history_has_a_gap_ends_with_an_error(server):
    """A dead worker's request whose reply stream lost its first reply cannot be continued
    exactly: the heir ends it with an error its gateway will deliver (never repeat or skip)."""
    r = server.client()
    r.delete(REPLIES)
    replies = Replies(r)
    with contextlib.suppress(redis.ResponseError):  # the module's workers made it
        r.xgroup_create(REQUESTS, WORKER_GROUP, id="0", mkstream=True)
    send(r, "gap", SamplingParams(max_tokens=50, seed=1, ignore_eos=True))
    r.xreadgroup(WORKER_GROUP, "ghost", {REQUESTS: ">"}, count=1)  # held by a dead worker
    r.xadd(REPLIES, encode_replies([ReplyMessage("gap", 1, [7])]))  # seq 0 is gone
    heir = start_worker(server, "heir-gap")
    try:
        wait_ready(r, heir)
        final = replies.wait("gap")["gap"]
    finally:
        heir.proc.stop()
    assert final.finish_reason == "error" and "could not be recovered" in (final.error or "")
    assert final.seq == HISTORY_LOST_SEQ
    assert pending_ids(r) == []
