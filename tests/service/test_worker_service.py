"""`jitney worker` against a real redis-server: the test stands in for the gateway (XADD requests,
XREAD replies), reads the worker's /metrics, cancels and signals it."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator

import pytest
import redis

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import load_model
from engine.step_timing import PHASES, PUBLISH
from protocol import (
    STOP_STRING,
    WORKER_GROUP,
    CancelMessage,
    Keys,
    ReplyMessage,
    RequestMessage,
    SamplingParams,
    decode_replies,
)
from tests.engine.engine_helpers import assert_greedy_parity
from tests.services import (
    JitneyProcess,
    RedisServer,
    Worker,
    http_status,
    start_worker,
    wait_for,
    wait_ready,
)

KEYS = Keys()
MODEL = "tiny-random"
REQUESTS = KEYS.requests(MODEL)
REPLIES = KEYS.replies("test-gw")
LONG = 1500  # max_tokens of a request that is still running when the test acts on it
REPLY_TIMEOUT = 60


def send(r: redis.Redis, request_id: str, prompt: list[int], max_tokens: int, **kw) -> str:
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    msg = RequestMessage(
        request_id, kw.pop("model", MODEL), prompt, sampling, REPLIES, "test-gw", time.time(), **kw
    )
    return r.xadd(REQUESTS, msg.encode()).decode()


class Replies:
    """The gateway's side of the reply stream: everything read so far, per request."""

    def __init__(self, r: redis.Redis):
        self.r = r
        self.last_id = "0-0"
        self.by_request: dict[str, list[ReplyMessage]] = {}

    def poll(self) -> None:
        for _, entries in self.r.xread({REPLIES: self.last_id}, block=200) or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                for reply in decode_replies(fields):  # a worker step's batch
                    self.by_request.setdefault(reply.request_id, []).append(reply)

    def final(self, request_id: str) -> ReplyMessage | None:
        got = self.by_request.get(request_id, [])
        return got[-1] if got and got[-1].is_final else None

    def wait(self, *request_ids: str, timeout: float = REPLY_TIMEOUT) -> dict[str, ReplyMessage]:
        deadline = time.monotonic() + timeout
        while not all(self.final(i) for i in request_ids):
            assert time.monotonic() < deadline, f"no final reply in {timeout} s: {request_ids}"
            self.poll()
        return {i: self.final(i) for i in request_ids}  # type: ignore[misc]

    def wait_for_tokens(self, request_id: str, n: int) -> None:
        deadline = time.monotonic() + REPLY_TIMEOUT
        while sum(len(m.token_ids) for m in self.by_request.get(request_id, [])) < n:
            assert time.monotonic() < deadline, f"{request_id}: fewer than {n} tokens"
            self.poll()

    def tokens(self, request_id: str) -> list[int]:
        """Joined token ids, after checking seqs run 0, 1, 2, ... with no gap or duplicate."""
        got = self.by_request[request_id]
        assert [m.seq for m in got] == list(range(len(got)))
        assert [m.is_final for m in got] == [False] * (len(got) - 1) + [True]
        return [t for m in got for t in m.token_ids]


def ready_status(worker: Worker) -> int:
    return http_status(f"http://127.0.0.1:{worker.metrics_port}/ready")


def pending_ids(r: redis.Redis, consumer: str | None = None) -> list[str]:
    kw = {"consumername": consumer} if consumer else {}
    rows = r.xpending_range(REQUESTS, WORKER_GROUP, "-", "+", 100, **kw)
    return [row["message_id"].decode() for row in rows]


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 280) for _ in range(n)]


# ----- one worker, shared by the tests that do not stop it --------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def stack(server: RedisServer) -> Iterator[tuple[redis.Redis, Worker]]:
    worker = start_worker(server, "w1")
    r = server.client()
    try:
        wait_ready(r, worker)
        yield r, worker
    finally:
        worker.proc.stop()


@pytest.fixture
def replies(stack: tuple[redis.Redis, Worker]) -> Replies:
    r, _ = stack
    r.delete(REPLIES)
    return Replies(r)


def test_concurrent_greedy_requests_match_offline_generate(stack, replies):
    """Joined reply tokens equal Engine.generate of the same prompts; seqs and usage exact."""
    r, _ = stack
    rng = random.Random(4)
    jobs = [
        (f"par-{i}", random_prompt(rng, rng.randint(3, 40)), rng.randint(5, 20)) for i in range(6)
    ]
    for request_id, prompt, n in jobs:
        send(r, request_id, prompt, n)
    finals = replies.wait(*(j[0] for j in jobs))

    engine = Engine(EngineConfig(model=MODEL, kv_cache_memory="16MiB"))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, _, n in jobs]
    offline = engine.generate([prompt for _, prompt, _ in jobs], params)
    ref = load_model(MODEL)  # on transformers' own attention, to judge near-ties
    for (request_id, prompt, n), want in zip(jobs, offline, strict=True):
        got = replies.tokens(request_id)
        assert_greedy_parity(ref, prompt, got, want.token_ids)
        final = finals[request_id]
        assert final.finish_reason == "length"
        assert (final.prompt_tokens, final.completion_tokens) == (len(prompt), n)
    assert pending_ids(r) == []  # every entry acknowledged


@pytest.mark.parametrize(("reason", "finish"), [("client_gone", "abort"), (STOP_STRING, "stop")])
def test_cancel_mid_generation_frees_slot_and_kv(stack, replies, reason, finish):
    """A cancel ends a running request within a step: final `abort` (`stop` when the gateway
    found a stop string: a normal end), running 0, KV back to 0."""
    r, worker = stack
    rid = f"cancel-{reason}"
    send(r, rid, [5, 6, 7, 8], LONG)
    replies.wait_for_tokens(rid, 3)
    r.set(KEYS.cancelled(rid), 1, ex=60)
    r.xadd(KEYS.cancels, CancelMessage(rid, reason).encode())
    final = replies.wait(rid)[rid]
    tokens = replies.tokens(rid)
    assert final.finish_reason == finish and 3 <= len(tokens) < LONG
    assert final.completion_tokens == len(tokens)
    wait_for(lambda: worker.metric("jitney_requests_running") == 0, 10, "running 0")
    assert worker.metric("jitney_kv_cache_usage_ratio") == 0
    assert worker.metric("jitney_kv_blocks_free") == worker.metric("jitney_kv_blocks_total")
    assert pending_ids(r) == []


def test_queued_cancelled_entry_is_dropped_and_past_deadline_expires(stack, replies):
    """Entries whose client left or whose deadline passed never reach prefill."""
    r, worker = stack
    prompt_before = worker.metric("jitney_prompt_tokens_total")
    expired_before = worker.metric("jitney_requests_finished_total", reason="expired")
    r.set(KEYS.cancelled("gone"), 1, ex=60)
    send(r, "gone", [5, 6, 7], 8)
    send(r, "late", [5, 6, 7], 8, deadline=time.time() - 1)
    send(r, "fine", [5, 6, 7], 2)
    finals = replies.wait("gone", "late", "fine")
    assert finals["gone"].finish_reason == "abort" and finals["gone"].seq == 0
    assert finals["late"].finish_reason == "expired" and finals["late"].seq == 0
    assert finals["gone"].completion_tokens == finals["late"].completion_tokens == 0
    assert finals["fine"].finish_reason == "length"
    # Only `fine` was prefilled.
    assert worker.metric("jitney_prompt_tokens_total") - prompt_before == 3
    assert worker.metric("jitney_requests_finished_total", reason="expired") - expired_before == 1
    assert pending_ids(r) == []


def test_invalid_requests_get_an_error_and_the_worker_keeps_serving(stack, replies):
    """Too long, bad token ids, wrong model, ill-typed sampling: an error reply and XACK;
    garbage: XACK only."""
    r, _ = stack
    send(r, "too-long", [5] * 2040, 100)
    send(r, "bad-token", [5, 10_000], 4)
    send(r, "other-model", [5, 6], 4, model="not-served")
    sampling = {"max_tokens": 4, "top_k": "many"}
    bad = RequestMessage("bad-sampling", MODEL, [5, 6], sampling, REPLIES, "test-gw", time.time())
    r.xadd(REQUESTS, bad.encode())
    r.xadd(REQUESTS, {"v": "1", "m": "{not json"})
    send(r, "after", [5, 6, 7], 4)
    invalid = ("too-long", "bad-token", "other-model", "bad-sampling")
    finals = replies.wait(*invalid, "after")
    for request_id in invalid:
        final = finals[request_id]
        assert final.finish_reason == "error" and final.error_type == "invalid_request_error"
        assert final.seq == 0 and final.error
    assert "2140" in finals["too-long"].error and "2048" in finals["too-long"].error
    assert finals["bad-sampling"].error == "top_k must be an integer, got str"
    assert finals["after"].finish_reason == "length" and len(replies.tokens("after")) == 4
    assert pending_ids(r) == []


def test_metrics_agree_with_what_was_served(stack, replies):
    """Token counters, finish reasons and latency histograms count exactly what was served."""
    r, worker = stack
    names = [
        "jitney_generation_tokens_total",
        "jitney_prompt_tokens_total",
        "jitney_time_to_first_token_seconds_count",
        "jitney_e2e_request_latency_seconds_count",
        "jitney_queue_delay_seconds_count",
    ]
    before = {n: worker.metric(n) for n in names}
    length_before = worker.metric("jitney_requests_finished_total", reason="length")
    rng = random.Random(7)
    jobs = [(f"m-{i}", random_prompt(rng, 10 + i), 3 + i) for i in range(4)]
    for request_id, prompt, n in jobs:
        send(r, request_id, prompt, n)
    finals = replies.wait(*(j[0] for j in jobs)).values()
    delta = {n: worker.metric(n) - before[n] for n in names}
    assert delta["jitney_generation_tokens_total"] == sum(f.completion_tokens for f in finals)
    assert delta["jitney_prompt_tokens_total"] == sum(f.prompt_tokens for f in finals) == 46
    for n in names[2:]:
        assert delta[n] == 4, n
    assert worker.metric("jitney_requests_finished_total", reason="length") - length_before == 4
    assert worker.metric("jitney_kv_blocks_total") == 2048
    # How the engine runs, for dashboards: the tiny dense model keeps float32 K/V.
    engine_info = {"forward": "jitney-none", "kv_cache_dtype": "float32", "block_size": "16"}
    assert worker.metric("jitney_engine_info", **engine_info) == 1
    assert worker.metric("jitney_batch_size_count") > 0
    assert worker.metric("jitney_step_duration_seconds_count") > 0
    labels = {"model": MODEL, "worker": "w1"}
    assert worker.metric("jitney_requests_running", **labels) == 0


def test_each_request_s_speculation_is_in_its_final_reply_and_the_metrics(stack, replies):
    """The worker speculates by default (n-gram): each final reply says how many draft tokens
    its request verified and kept, which add up to the worker's counters, and each request
    that verified drafts is one observation of the per-request histograms."""
    r, worker = stack
    names = [
        "jitney_spec_decode_num_draft_tokens_total",
        "jitney_spec_decode_num_accepted_tokens_total",
        "jitney_spec_decode_request_acceptance_ratio_count",
        "jitney_spec_decode_request_mean_accepted_length_count",
    ]
    before = {n: worker.metric(n) for n in names}
    # The tiny random model's greedy text soon repeats itself: prompt lookup finds its loops.
    rng = random.Random(5)
    jobs = [(f"spec-{i}", random_prompt(rng, 12), 120) for i in range(3)]
    for request_id, prompt, n in jobs:
        send(r, request_id, prompt, n)
    finals = list(replies.wait(*(j[0] for j in jobs)).values())
    delta = {n: worker.metric(n) - before[n] for n in names}
    assert all(0 <= f.accepted_draft_tokens <= f.draft_tokens for f in finals)
    assert sum(f.accepted_draft_tokens for f in finals) > 0
    assert delta[names[0]] == sum(f.draft_tokens for f in finals)
    assert delta[names[1]] == sum(f.accepted_draft_tokens for f in finals)
    speculated = sum(1 for f in finals if f.draft_tokens)
    assert delta[names[2]] == delta[names[3]] == speculated
    # The row price the policy bets with, measured from the worker's own steps.
    cost = worker.metric("jitney_spec_decode_draft_row_cost", required=True, worker="w1")
    assert 0 <= cost <= 1
    # The first prompt again: before its own text loops, its drafts come from the earlier reply.
    history = ["jitney_spec_decode_history_draft_tokens_total", names[0]]
    history += ["jitney_spec_decode_history_accepted_tokens_total", names[1]]
    before = {n: worker.metric(n) for n in history}
    send(r, "spec-again", jobs[0][1], 120)
    (again,) = replies.wait("spec-again").values()
    delta = {n: worker.metric(n) - before[n] for n in history}
    assert 0 < delta[history[2]] <= delta[history[0]] <= delta[names[0]] == again.draft_tokens
    assert delta[history[2]] <= delta[names[1]] == again.accepted_draft_tokens


def test_step_phases_are_exported_per_step_and_add_up_to_the_step(stack, replies):
    """jitney_step_phase_seconds: each engine phase once per step, summing to the step's
    duration; `publish` once per reply round trip."""
    r, worker = stack

    def totals() -> dict[str, float]:
        got = {
            f"{p}_{stat}": worker.metric(f"jitney_step_phase_seconds_{stat}", phase=p)
            for p in (*PHASES, PUBLISH)
            for stat in ("count", "sum")
        }
        got["steps"] = worker.metric("jitney_step_duration_seconds_count")
        got["step_s"] = worker.metric("jitney_step_duration_seconds_sum")
        return got

    before = totals()
    send(r, "phases", [5, 6, 7, 8, 9], 12)
    replies.wait("phases")
    wait_for(  # the publish of the final reply is observed just after it returns
        lambda: totals()[f"{PUBLISH}_count"] > before[f"{PUBLISH}_count"], 5, "publish"
    )
    delta = {k: v - before[k] for k, v in totals().items()}
    assert delta["steps"] >= 12
    for p in PHASES:
        assert delta[f"{p}_count"] == delta["steps"], p
        assert (delta[f"{p}_sum"] > 0) == (p != "propose"), p  # (no draft model)
    assert sum(delta[f"{p}_sum"] for p in PHASES) == pytest.approx(delta["step_s"], rel=0.1)
    assert 1 <= delta[f"{PUBLISH}_count"] <= delta["steps"] and delta[f"{PUBLISH}_sum"] > 0


def test_worker_survives_a_redis_restart(server, stack, replies):
    """Redis goes away and comes back empty: the worker backs off, rejoins (group, card,
    heartbeat) and serves again without restarting."""
    r, worker = stack
    server.stop()
    wait_for(lambda: "redis_unavailable" in worker.proc.output(), 15, "the worker to notice")
    assert worker.proc.alive()
    server.start()
    wait_for(lambda: r.zscore(KEYS.workers, "w1") is not None, 15, "heartbeat after restart")
    wait_for(lambda: r.exists(KEYS.model(MODEL)), 5, "model card re-published")
    send(r, "after-restart", [5, 6, 7], 4)
    assert replies.wait("after-restart")["after-restart"].finish_reason == "length"
    log = worker.proc.output()
    assert "redis_unavailable" in log and "redis_recovered" in log
    assert "Traceback" not in log


# ----- tests that own their workers ---------------------------------------------------------------
def test_two_workers_share_the_queue_and_a_full_worker_does_not_hoard(redis_server):
    """With one slot each: the worker busy on a long request never reads the next ones; the
    other serves them at once. SIGTERM then hands the long one back after --shutdown-timeout and
    the other worker continues it: one stream, seqs without gap or repeat, text as offline."""
    r = redis_server.client()
    # Without speculation: a step gives one token, so the long request outlasts the timeout.
    flags = ("--max-num-seqs", "1", "--shutdown-timeout", "1", "--speculative", "none")
    workers = [start_worker(redis_server, w, *flags) for w in ("wa", "wb")]
    try:
        wait_ready(r, *workers)
        replies = Replies(r)
        long_entry = send(r, "long", [5, 6, 7], LONG)
        replies.wait_for_tokens("long", 2)
        (busy,) = [w for w in workers if pending_ids(r, w.worker_id) == [long_entry]]
        (free,) = [w for w in workers if w is not busy]
        short = [f"short-{i}" for i in range(3)]
        for request_id in short:
            send(r, request_id, [5, 6, 7], 4)
        finals = replies.wait(*short, timeout=30)
        assert all(f.finish_reason == "length" for f in finals.values())
        assert replies.final("long") is None  # still running: the shorts did not wait for it
        assert pending_ids(r, busy.worker_id) == [long_entry]  # it never read them
        assert free.metric("jitney_requests_finished_total", reason="length") == 3
        assert busy.metric("jitney_requests_finished_total") == 0
        assert busy.metric("jitney_requests_running") == 1

        assert busy.proc.stop() == 0  # SIGTERM: the long request cannot finish within 1 s
        assert "handed_back" in busy.proc.output()
        final = replies.wait("long")["long"]
        assert final.finish_reason == "length" and final.error is None
        got = replies.tokens("long")  # checks seq 0, 1, 2, ... across both workers
        assert final.completion_tokens == len(got) == LONG
        assert free.metric("jitney_request_handoffs_total", event="taken_over") == 1
        engine = Engine(EngineConfig(model=MODEL, kv_cache_memory="16MiB"))
        params = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
        (want,) = engine.generate([[5, 6, 7]], params)
        assert_greedy_parity(load_model(MODEL), [5, 6, 7], got, want.token_ids)
        assert pending_ids(r) == [] and r.xlen(REQUESTS) == 0  # acked and deleted
        assert r.zscore(KEYS.workers, busy.worker_id) is None
        assert r.zscore(KEYS.workers, free.worker_id) is not None
    finally:
        for w in workers:
            w.proc.stop()


def test_sigterm_finishes_in_flight_requests_and_stops_reading(redis_server):
    """SIGTERM: no new reads, in-flight requests finish normally, exit 0, heartbeat removed."""
    r = redis_server.client()
    slow = {"JITNEY_FAILPOINTS": "step_delay_ms=10"}  # 200 tokens take 2 s: time to look
    worker = start_worker(redis_server, "wterm", "--shutdown-timeout", "60", env=slow)
    try:
        wait_ready(r, worker)
        replies = Replies(r)
        in_flight = [f"inflight-{i}" for i in range(4)]
        for i, request_id in enumerate(in_flight):
            send(r, request_id, [5, 6, 7 + i], 200)
        for request_id in in_flight:
            replies.wait_for_tokens(request_id, 1)
        assert not any(replies.final(i) for i in in_flight)
        assert ready_status(worker) == 200
        worker.proc.proc.terminate()
        # A rolling update's readiness turns off while the worker still drains (it cannot
        # finish 4 x 200 tokens at 10 ms a step before /ready answers 503).
        wait_for(lambda: ready_status(worker) == 503, 10, "/ready to turn 503 while draining")
        late_entry = send(r, "late", [5, 6, 7], 4)
        assert worker.proc.proc.wait(60) == 0
        finals = replies.wait(*in_flight, timeout=5)
        assert all(f.finish_reason == "length" for f in finals.values())
        assert all(len(replies.tokens(i)) == 200 for i in in_flight)
        assert replies.final("late") is None and pending_ids(r) == []
        # The late entry is still there for another worker.
        other = r.xreadgroup(WORKER_GROUP, "probe", {REQUESTS: ">"}, count=10)
        assert [e[0].decode() for e in other[0][1]] == [late_entry]
        assert r.zscore(KEYS.workers, "wterm") is None
        assert "worker_stopped" in worker.proc.output()
    finally:
        worker.proc.stop()


def test_a_bug_in_add_request_is_a_server_error_not_the_clients(redis_server):
    """Engine.add_request raises a ValueError that is no engine rejection (the start_error_token
    failpoint): the request is not answered as invalid. Like a failed step it goes back as a
    failed delivery, and after MAX_DELIVERIES it is dead-lettered with a server error; the
    worker keeps serving the others."""
    r = redis_server.client()
    bug_token = 251
    env = {"JITNEY_FAILPOINTS": f"start_error_token={bug_token}"}
    worker = start_worker(redis_server, "wbug", env=env)
    try:
        wait_ready(r, worker)
        replies = Replies(r)
        send(r, "bug", [5, bug_token, 7], 4)
        send(r, "fine", [5, 6, 7], 4)
        finals = replies.wait("bug", "fine", timeout=30)
        bug = finals["bug"]
        assert bug.finish_reason == "error" and bug.error_type == "server_error", bug
        assert "dead-lettered" in (bug.error or "") and bug.seq == 0
        assert replies.tokens("bug") == []  # its only reply: the error
        assert finals["fine"].finish_reason == "length" and len(replies.tokens("fine")) == 4
        (dead,) = r.xrange(KEYS.dead_letters)
        assert b"failed on 3 deliveries" in dead[1][b"reason"]
        assert worker.proc.alive()
        log = worker.proc.output()
        assert log.count("start_failed") == 3 and "failpoint start_error_token" in log
        assert worker.metric("jitney_request_handoffs_total", event="dead_lettered") == 1
        assert worker.metric("jitney_requests_finished_total", reason="error") == 1
        wait_for(lambda: pending_ids(r) == [], 10, "every entry acked")
    finally:
        worker.proc.stop()


def test_worker_with_its_metrics_port_taken_exits_2_with_a_clear_error(redis_server):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [
            "worker",
            "--model",
            MODEL,
            "--kv-cache-memory",
            "16MiB",
            "--metrics-port",
            str(port),
            "--worker-id",
            "wport",
        ]
        proc = JitneyProcess(args, {"REDIS_URL": redis_server.url}, name="wport")
        assert proc.proc.wait(60) == 2
    out = proc.output()
    assert f"cannot_start metrics_port={port}" in out and "Traceback" not in out


def test_vllm_metric_names_mirror_the_workers_own(redis_server):
    """--vllm-metrics: the same values under vLLM's names, for dashboards written for vLLM."""
    r = redis_server.client()
    worker = start_worker(redis_server, "wvllm", "--vllm-metrics")
    try:
        wait_ready(r, worker)
        replies = Replies(r)
        send(r, "v1", [5, 6, 7], 6)
        send(r, "v2", [8, 9], 3)
        replies.wait("v1", "v2")
        pairs = {
            "jitney_generation_tokens_total": "vllm:generation_tokens_total",
            "jitney_prompt_tokens_total": "vllm:prompt_tokens_total",
            "jitney_time_to_first_token_seconds_count": "vllm:time_to_first_token_seconds_count",
            "jitney_requests_running": "vllm:num_requests_running",
            "jitney_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
        }
        assert worker.metric("jitney_generation_tokens_total") == 9
        for ours, theirs in pairs.items():
            assert worker.metric(theirs, model_name=MODEL) == worker.metric(ours), theirs
        assert worker.metric("vllm:request_success_total", finished_reason="length") == 2
    finally:
        worker.proc.stop()


def test_worker_with_a_stall_timeout_under_its_idle_block_refuses_to_start(redis_server):
    """An idle worker blocks on the stream for --idle-block-ms: a shorter --stall-timeout would
    make it look hung to itself. Refused at start with the reason."""
    args = [
        "worker",
        "--model",
        MODEL,
        "--kv-cache-memory",
        "16MiB",
        "--metrics-port",
        "0",
        "--idle-block-ms",
        "1000",
        "--stall-timeout",
        "0.5",
    ]
    proc = JitneyProcess(args, {"REDIS_URL": redis_server.url}, name="wstall")
    assert proc.proc.wait(60) == 2
    assert "cannot_start" in proc.output() and "stall_timeout" in proc.output()
    assert "Traceback" not in proc.output()


def test_replies_a_gateway_had_not_read_are_sent_again_when_redis_comes_back_empty():
    """Redis restarts without persistence while a request streams and the gateway has not read
    the last replies (here: it stops reading for a moment): the worker publishes the replies of
    the moments before the outage again, so the gateway's stream has every seq and no gap
    (copies of what it had read are dropped by seq, as the gateway does)."""
    server = RedisServer().start()
    slow = {"JITNEY_FAILPOINTS": "step_delay_ms=15"}  # about 60 tokens a second
    worker = start_worker(server, "resend", env=slow)
    try:
        r = server.client()
        wait_ready(r, worker)
        replies = Replies(r)
        send(r, "restart", random_prompt(random.Random(9), 12), 400)
        replies.wait_for_tokens("restart", 20)
        time.sleep(0.5)  # published while nobody reads: unread when Redis restarts
        server.stop()
        time.sleep(0.5)
        server.start()
        replies.last_id = "0-0"  # the stream comes back empty
        final = replies.wait("restart")["restart"]
        by_seq = {m.seq: m for m in replies.by_request["restart"]}
        assert sorted(by_seq) == list(range(final.seq + 1))
        assert sum(len(m.token_ids) for m in by_seq.values()) == 400
    finally:
        worker.proc.stop()
        server.close()
