"""Faults on the real system (redis-server, gateway and worker processes): every accepted
request ends with exactly one outcome the client sees, and nothing is duplicated or lost."""

from __future__ import annotations

import asyncio
import random
import signal

import aiohttp
import pytest
import redis

from engine.models.model_loader import load_model
from tests.service.helpers import (
    KEYS,
    MODEL,
    PLACED,
    assert_nothing_left,
    assert_same_greedy_text,
    complete,
    offline,
    own_reads,
    pending_by_consumer,
    read_since,
    reads,
    stream_completion,
)
from tests.services import System, Worker, http_status, running_system, start_worker, wait_for

pytestmark = pytest.mark.slow


def random_prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


async def placed_prompts(
    session: aiohttp.ClientSession, system: System, prompts: list[list[int]]
) -> list[list[int]]:
    """`prompts`, each after one of two 48-token prefixes (three full blocks), one held by each
    worker: a prefix is first sent alone (a short request, read from the shared stream) until
    each worker has read one. Each prompt is then placed on the own stream of the worker holding
    its prefix (while that worker has room)."""
    rng = random.Random(29)
    held: dict[str, list[int]] = {}  # worker id -> the prefix it holds
    # Whichever worker is blocked reading takes the next entry; on a loaded machine one worker
    # can take ten in a row (a fresh-clone CI run), so up to 40 short requests.
    for _ in range(40):
        prefix = [rng.randrange(3, 250) for _ in range(48)]
        before = reads(system.workers)
        await complete(session, system.base, prefix, max_tokens=1)
        ((worker_id, _),) = read_since(before, system.workers)
        held.setdefault(worker_id, prefix)
        if len(held) == len(system.workers):
            break
    assert len(held) == len(system.workers), f"one worker read every prefix: {held.keys()}"
    prefixes = list(held.values())
    return [[*prefixes[i % len(prefixes)], *p] for i, p in enumerate(prompts)]


def start_streams(
    session: aiohttp.ClientSession, base: str, body: dict, prompts: list[list[int]], **kw: bool
) -> list[asyncio.Task[tuple[str, dict]]]:
    return [
        asyncio.create_task(stream_completion(session, base, {**body, "prompt": p}, **kw))
        for p in prompts
    ]


async def wait_generating(workers: list[Worker], tokens: int) -> None:
    def generating() -> bool:
        return all(w.metric("jitney_generation_tokens_total") > tokens for w in workers)

    await asyncio.to_thread(wait_for, generating, 60, "every worker generating")


def by_pending(r: redis.Redis, workers: list[Worker]) -> tuple[list[Worker], dict[str, int]]:
    """The workers, most pending entries first (in any stream of the model's queues), and the
    pending counts."""
    pending = pending_by_consumer(r)
    return sorted(workers, key=lambda w: -pending.get(w.worker_id, 0)), pending


def own_pending(r: redis.Redis, worker: Worker) -> int:
    """Entries `worker` read from its own stream (placed there) and has not acknowledged."""
    own = KEYS.requests(MODEL, worker=worker.worker_id)
    return pending_by_consumer(r, [own]).get(worker.worker_id, 0)


def kv_idle(worker: Worker) -> bool:
    return worker.metric("jitney_requests_running") == 0 and worker.metric(
        "jitney_kv_blocks_free"
    ) == worker.metric("jitney_kv_blocks_total")


SPECULATING = ("--speculative", "ngram", "--speculative-max-step-tokens", "64")
# The target as its own draft: its proposals are nearly always kept, so a step gives several
# tokens; the survivor's draft model catches each taken-over sequence up from its prompt.
DRAFTING = ("--speculative-model", MODEL, "--speculative-max-step-tokens", "64")


@pytest.mark.parametrize(
    "flags",
    [(), SPECULATING, DRAFTING, PLACED],
    ids=["plain", "speculating", "draft-model", "placement"],
)
async def test_worker_killed_mid_generation_loses_and_repeats_nothing(flags: tuple[str, ...]):
    """12 concurrent greedy streams over two workers; one worker is SIGKILLed at a random
    moment mid-generation. The other takes its requests over (lease expiry, fence, XCLAIM) and
    continues after the tokens already delivered: every client's text equals a no-fault run.
    Speculating, the victim dies between verifications that gave several tokens a step. With
    placement, requests were placed on (and read from) the own stream of the worker holding
    their prefix: those the victim read are taken over from there."""
    placed, speculating = flags == PLACED, flags in (SPECULATING, DRAFTING)
    # Replies long enough to keep every request in flight past the kill: a tiny model's step
    # takes about a millisecond (a fresh-clone run finished all 160-token replies within the
    # wait), and speculating, a step gives up to five tokens.
    n, prompts = 480, random_prompts(11, 12)
    body = {"model": MODEL, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    gateway_flags = PLACED if placed else ()
    with running_system(("k1", "k2"), flags, gateway_flags=gateway_flags) as system:
        r = system.server.client()
        async with aiohttp.ClientSession() as session:
            if placed:
                prompts = await placed_prompts(session, system, prompts)
            streams = start_streams(session, system.base, body, prompts)
            # Both workers generating, then a random moment later, the busier one dies.
            await wait_generating(system.workers, 20)
            await asyncio.sleep(random.Random(3).uniform(0.0, 0.8))
            (victim, survivor), pending = by_pending(r, system.workers)
            assert pending.get(victim.worker_id, 0) > 0
            placed_pending = own_pending(r, victim) if placed else 0
            victim.proc.proc.kill()
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        ref = load_model(MODEL)
        for prompt, want, (text, usage) in zip(prompts, offline(prompts, n), results, strict=True):
            assert usage["completion_tokens"] == n and usage["prompt_tokens"] == len(prompt)
            assert_same_greedy_text(ref, prompt, text, want)
        taken = survivor.metric("jitney_request_handoffs_total", event="taken_over")
        assert taken == pending[victim.worker_id]
        if speculating:
            assert survivor.metric("jitney_spec_decode_num_accepted_tokens_total") > 0
        if placed:  # some of what it took over waited in the victim's own stream
            assert placed_pending > 0 and own_reads([survivor]) > 0
        assert r.exists(KEYS.fenced(victim.worker_id))
        wait_for(lambda: kv_idle(survivor), 10, "survivor idle")
        assert_nothing_left(r)


async def test_killed_gateway_requests_are_aborted_by_the_workers():
    """The gateway dies with streams in flight: its heartbeat lapses, the worker aborts its
    requests (slots and KV freed) instead of generating for nobody."""
    body = {
        "model": MODEL,
        "prompt": "x y z",
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    slow = {"JITNEY_FAILPOINTS": "step_delay_ms=20"}  # 1500 tokens take 30 s
    with running_system(("gw-orphans",), worker_env=slow) as system:
        (worker,) = system.workers
        async with aiohttp.ClientSession() as session:
            responses = [
                await session.post(f"{system.base}/v1/completions", json=body) for _ in range(3)
            ]
            assert all(resp.status == 200 for resp in responses)
            await asyncio.to_thread(
                wait_for, lambda: worker.metric("jitney_requests_running") == 3, 30, "3 running"
            )
            system.gateway.proc.proc.kill()
            for resp in responses:
                resp.close()
        wait_for(lambda: kv_idle(worker), 30, "the dead gateway's requests aborted")
        assert worker.metric("jitney_request_handoffs_total", event="gateway_gone") == 3
        assert worker.metric("jitney_requests_finished_total", reason="abort") == 3
        assert_nothing_left(system.server.client())


async def test_poison_request_is_dead_lettered_and_the_rest_are_served():
    """A request that makes every step fail (failpoint on a token id) is handed back, retried
    and dead-lettered after MAX_DELIVERIES, with an error to its client; the requests that shared
    its batches finish with the right text; the worker keeps serving."""
    poison_token = 251
    prompts = random_prompts(5, 4)
    n = 24
    body = {"model": MODEL, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    env = {"JITNEY_FAILPOINTS": f"step_error_token={poison_token}"}
    with running_system(("poisoned",), worker_env=env) as system:
        (worker,) = system.workers
        async with aiohttp.ClientSession() as session:

            async def complete(prompt: list[int]) -> tuple[int, dict]:
                async with session.post(
                    f"{system.base}/v1/completions", json={**body, "prompt": prompt}
                ) as resp:
                    return resp.status, await resp.json()

            results = await asyncio.gather(
                complete([5, poison_token, 9]), *[complete(p) for p in prompts]
            )
        (status, error), *served = results
        assert status == 500 and error["error"]["type"] == "server_error"
        assert "dead-lettered" in error["error"]["message"]
        ref = load_model(MODEL)
        for prompt, want, (status, data) in zip(prompts, offline(prompts, n), served, strict=True):
            assert status == 200, data
            assert_same_greedy_text(ref, prompt, data["choices"][0]["text"], want)
        r = system.server.client()
        (dead,) = r.xrange(KEYS.dead_letters)
        assert b"failed on 3 deliveries" in dead[1][b"reason"]
        assert worker.proc.alive()
        assert worker.metric("jitney_request_handoffs_total", event="dead_lettered") == 1
        assert "step_failed" in worker.proc.output()
        wait_for(lambda: kv_idle(worker), 10, "worker idle")
        assert_nothing_left(r)


@pytest.mark.parametrize("appendonly", [True, False], ids=["aof", "no-persistence"])
async def test_redis_restart_mid_stream_ends_every_request(appendonly):
    """Redis restarts while streams are in flight. With AOF every request finishes with the
    no-fault text; without persistence each one finishes or ends with an explicit error. No
    process crashes and no client hangs."""
    n, prompts = 200, random_prompts(8, 6)
    body = {"model": MODEL, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    with running_system(("rr1",), appendonly=appendonly) as system:
        (worker,) = system.workers
        async with aiohttp.ClientSession() as session:
            streams = start_streams(session, system.base, body, prompts, allow_error=True)
            await wait_generating([worker], 50)
            system.server.stop()  # SIGTERM: with AOF, Redis writes everything before exiting
            await asyncio.sleep(1.0)
            system.server.start()
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        ref = load_model(MODEL)
        for prompt, want, (text, usage) in zip(prompts, offline(prompts, n), results, strict=True):
            if appendonly or "error" not in usage:
                assert usage.get("completion_tokens") == n, usage
                assert_same_greedy_text(ref, prompt, text, want)
            else:
                assert usage["error"]["message"]
        assert worker.proc.alive() and system.gateway.proc.alive()
        wait_for(lambda: kv_idle(worker), 30, "worker idle")


@pytest.mark.parametrize("placed", [False, True], ids=["shared", "placement"])
async def test_a_paused_worker_is_fenced_and_its_requests_finish_elsewhere(placed: bool):
    """A worker frozen past its lease (SIGSTOP: a long GC pause, a partition) has its requests
    taken over; when it wakes up its late writes are refused (fenced), it drops those requests
    and rejoins. Each client still sees one stream without repeats or gaps. With placement,
    requests were placed on the own stream of the worker holding their prefix."""
    n, prompts = 120, random_prompts(21, 6)
    body = {"model": MODEL, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    slow = {"JITNEY_FAILPOINTS": "step_delay_ms=15"}  # 120 tokens take about 2 s per worker
    flags = PLACED if placed else ()
    with running_system(("s1", "s2"), flags, slow, gateway_flags=flags) as system:
        r = system.server.client()
        async with aiohttp.ClientSession() as session:
            if placed:
                prompts = await placed_prompts(session, system, prompts)
            streams = start_streams(session, system.base, body, prompts)
            await wait_generating(system.workers, 5)
            (paused, survivor), _ = by_pending(r, system.workers)
            placed_pending = own_pending(r, paused) if placed else 0
            paused.proc.proc.send_signal(signal.SIGSTOP)
            await asyncio.to_thread(
                wait_for,
                lambda: survivor.metric("jitney_request_handoffs_total", event="taken_over") > 0,
                30,
                "takeover of the paused worker's requests",
            )
            paused.proc.proc.send_signal(signal.SIGCONT)
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        ref = load_model(MODEL)
        for prompt, want, (text, usage) in zip(prompts, offline(prompts, n), results, strict=True):
            assert usage["completion_tokens"] == n
            assert_same_greedy_text(ref, prompt, text, want)
        wait_for(lambda: "fenced" in paused.proc.output(), 10, "the paused worker fenced")
        wait_for(lambda: r.zscore(KEYS.workers, paused.worker_id) is not None, 10, "rejoined")
        for w in system.workers:
            wait_for(lambda w=w: kv_idle(w), 10, "idle")
        assert_nothing_left(r)
        if placed:  # some of what was taken over waited in the paused worker's own stream
            assert placed_pending > 0 and own_reads(system.workers) > 0


async def test_gateway_sigterm_drains_open_streams_then_exits():
    """A gateway told to stop (rolling update) turns /ready off and answers new requests 503
    at once, lets its open streams finish, then exits 0."""
    n = 100
    body = {
        "model": MODEL,
        "prompt": "drain",
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
    }
    slow = {"JITNEY_FAILPOINTS": "step_delay_ms=20"}  # the stream lasts about 2 s
    with running_system(("drain1",), worker_env=slow) as system:
        (worker,) = system.workers
        gateway = system.gateway
        async with aiohttp.ClientSession() as session:
            stream = asyncio.create_task(stream_completion(session, system.base, body))
            await asyncio.to_thread(
                wait_for, lambda: worker.metric("jitney_requests_running") == 1, 30, "streaming"
            )
            gateway.proc.proc.terminate()
            ready_url = f"{system.base}/ready"
            await asyncio.to_thread(
                wait_for, lambda: http_status(ready_url) == 503, 10, "/ready off while draining"
            )
            async with session.get(ready_url) as resp:
                assert resp.status == 503 and (await resp.json())["reason"] == "shutting down"
            async with session.post(f"{system.base}/v1/completions", json=body) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "shutting_down"
            text, usage = await asyncio.wait_for(stream, 30)
        assert usage["completion_tokens"] == n and text
        assert gateway.proc.proc.wait(30) == 0
        assert worker.metric("jitney_requests_finished_total", reason="length") == 1


async def test_gateway_shutdown_timeout_cancels_what_is_still_open():
    """Streams still open when the gateway's --shutdown-timeout runs out are cut and cancelled:
    the worker frees their slots and KV at once instead of generating for nobody."""
    body = {
        "model": MODEL,
        "prompt": "long",
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
    }
    slow = {"JITNEY_FAILPOINTS": "step_delay_ms=20"}  # 1500 tokens would take 30 s
    flags = ("--shutdown-timeout", "0.5")
    with running_system(("cut1",), worker_env=slow, gateway_flags=flags) as system:
        (worker,) = system.workers
        async with aiohttp.ClientSession() as session:
            stream = asyncio.create_task(stream_completion(session, system.base, body, True))
            await asyncio.to_thread(
                wait_for, lambda: worker.metric("jitney_requests_running") == 1, 30, "streaming"
            )
            system.gateway.proc.proc.terminate()
            with pytest.raises(aiohttp.ClientError):
                await asyncio.wait_for(stream, 30)  # cut: no [DONE]
        assert system.gateway.proc.proc.wait(30) == 0
        wait_for(lambda: kv_idle(worker), 10, "the cut request cancelled")
        assert worker.metric("jitney_requests_finished_total", reason="abort") == 1


@pytest.mark.parametrize("placed", [False, True], ids=["shared", "placement"])
async def test_a_hung_step_lets_the_lease_lapse_and_another_worker_finishes(placed: bool):
    """A worker whose step hangs (8 s here, past --stall-timeout 1 s plus the 5 s lease) stops
    renewing its lease although the process is alive; a second worker takes the request over and
    finishes it; the hung one, when its step returns, is refused (fenced) and rejoins. With
    placement on, nothing is placed (one worker when the request comes, and a warm-up would hang
    too), but both read, take over and fence with own streams and summaries about."""
    body = {"model": MODEL, "prompt": "hang", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    hang = {"JITNEY_FAILPOINTS": "step_delay_ms=8000"}
    placement = PLACED if placed else ()
    flags = ("--stall-timeout", "1", "--idle-block-ms", "200", *placement)
    with running_system(("hung",), flags, hang, gateway_flags=placement) as system:
        (hung,) = system.workers
        r = system.server.client()
        async with aiohttp.ClientSession() as session:
            call = asyncio.create_task(
                session.post(f"{system.base}/v1/completions", json={**body, "stream": False})
            )
            await asyncio.to_thread(
                wait_for, lambda: pending_by_consumer(r).get("hung", 0) == 1, 30, "taken"
            )
            helper = start_worker(system.server, "helper", *placement)
            try:
                resp = await asyncio.wait_for(call, 60)
                assert resp.status == 200
                assert (await resp.json())["usage"]["completion_tokens"] == 6
                assert helper.metric("jitney_request_handoffs_total", event="taken_over") == 1
                wait_for(lambda: "fenced" in hung.proc.output(), 30, "the hung worker fenced")
                assert hung.proc.alive()
            finally:
                helper.proc.stop()
        assert_nothing_left(r)
