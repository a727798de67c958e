"""Work classes through the whole system (real Redis, gateway, tiny-random workers): fair share
between API keys by weight, an urgent request taking a seat from less urgent work at once, and
interactive latency over a running batch that fills every seat."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.serving.backlog import BacklogMonitor
from protocol import Keys, RequestMessage
from protocol.queue import Queue, entry_cost
from tests.service.helpers import MODEL
from tests.service.test_batch_api import jsonl, output_lines, wait_completed
from tests.services import (
    RedisServer,
    Worker,
    running_system,
    start_worker,
    wait_for,
    wait_ready,
)
from worker.redis_io import Outbox, WorkerRedis

WEIGHTS = {"a": 1, "b": 1, "c": 2}
SHARES = {"a": 0.25, "b": 0.25, "c": 0.5}


def keys_file(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "keys"
    path.write_text("\n".join(lines) + "\n")
    return path


async def test_the_read_script_shares_tokens_by_weight(redis_server: RedisServer) -> None:
    """Three keys' queues at one priority, 1:1:2, all backlogged: what a worker reads, counted
    in tokens (prompt + max_tokens), splits 25/25/50, whatever the size of each key's requests:
    c sends requests twice as large, so it gets as many requests as a, for twice the tokens."""
    import redis.asyncio as aioredis

    keys = Keys()
    client = aioredis.Redis.from_url(redis_server.url)
    monitor = BacklogMonitor(client, keys, MODEL)
    cost = {"a": 100, "b": 100, "c": 200}
    try:
        for i in range(200):
            for key, weight in WEIGHTS.items():
                msg = RequestMessage(f"{key}{i}", MODEL, [1], {}, "r", "g", 0.0, key_id=key)
                await monitor.enqueue(msg, Queue(0, key, weight), cost[key])
    finally:
        await client.aclose()
    io = WorkerRedis(redis_server.client(), keys, "w", MODEL)
    tokens: Counter[str] = Counter()
    for _ in range(60):  # 240 entries: every queue still has a backlog throughout
        for entry in io.read_requests(4, None):
            key = RequestMessage.decode(entry.fields).key_id
            assert entry.queue == keys.requests(MODEL, 0, key)
            tokens[key] += cost[key]
    total = sum(tokens.values())
    for key, share in SHARES.items():
        assert abs(tokens[key] / total - share) <= 0.1 * share, (tokens, key)


async def test_unused_max_tokens_are_refunded_to_the_key_s_queue(redis_server: RedisServer) -> None:
    """Fair share is charged at prompt + max_tokens when read; a finished request gives back what
    it did not use. Key a asks for 1,000 tokens and uses 100, key b asks for and uses 100: with
    the refunds (what a worker's publish sends) they read alike, instead of a getting a tenth."""
    import redis.asyncio as aioredis

    keys = Keys()
    client = aioredis.Redis.from_url(redis_server.url)
    monitor = BacklogMonitor(client, keys, MODEL)
    asked, used = {"a": 1000, "b": 100}, 100
    try:
        for i in range(100):
            for key in asked:
                msg = RequestMessage(f"{key}{i}", MODEL, [1], {}, "r", "g", 0.0, key_id=key)
                await monitor.enqueue(msg, Queue(0, key, 1), asked[key])
    finally:
        await client.aclose()
    io = WorkerRedis(redis_server.client(), keys, "w", MODEL)
    reads: Counter[str] = Counter()
    for _ in range(40):
        outbox = Outbox()
        for entry in io.read_requests(2, None):
            reads[RequestMessage.decode(entry.fields).key_id] += 1
            outbox.acks.append(entry.ref)
            outbox.refunds.append((entry.queue, entry_cost(entry.fields) - used))
        assert io.publish(outbox)
    assert abs(reads["a"] - reads["b"]) <= 0.1 * reads["b"], reads
    deficits = redis_server.client().hgetall(keys.queue_deficits(MODEL))
    assert all(int(d) <= 0 for d in deficits.values())  # a refund lowers debt, banks no credit


@pytest.mark.slow
async def test_a_worker_refunds_what_its_requests_did_not_use(redis_server: RedisServer) -> None:
    """A real worker finishes two weighted keys' requests charged 1,000 tokens each that stop
    after 5: its publish hands the unused tokens back, so neither queue keeps the debt."""
    import redis.asyncio as aioredis

    keys = Keys()
    client = aioredis.Redis.from_url(redis_server.url)
    monitor = BacklogMonitor(client, keys, MODEL)
    sampling = {"max_tokens": 5, "ignore_eos": True}
    try:
        for key in ("a", "b"):
            msg = RequestMessage(key, MODEL, [1, 2], sampling, keys.replies("g"), "g", time.time())
            await monitor.enqueue(msg, Queue(0, key, 1), 1000)
    finally:
        await client.aclose()
    r = redis_server.client()
    worker = start_worker(redis_server, "refund-w")
    try:
        wait_ready(r, worker)
        queues = [keys.requests(MODEL, 0, key) for key in ("a", "b")]
        wait_for(lambda: sum(r.xlen(q) for q in queues) == 0, 30, "both answered and acked")
    finally:
        worker.proc.stop()
    deficits = {k.decode(): int(v) for k, v in r.hgetall(keys.queue_deficits(MODEL)).items()}
    # Charged 1,000 when read (about -999 after), refunded 1,000 - 2 - 5: only the used remain.
    assert all(-10 <= deficits[q] <= 0 for q in queues), deficits


@pytest.mark.slow
async def test_keys_weighted_1_1_2_get_token_shares_of_25_25_50(tmp_path: Path) -> None:
    """Each key sends the same backlog at once; two seats. While all three still have work
    waiting, the generated tokens split by weight, not by arrival."""
    path = keys_file(tmp_path, [f"{k}:key-{k} weight={w}" for k, w in WEIGHTS.items()])
    per_key, max_tokens = 16, 64
    gateway_flags = ("--api-keys-file", str(path))
    seats = ("--max-num-seqs", "2")
    with running_system(("fw1",), seats, gateway_flags=gateway_flags, api_key="key-a") as system:
        finished: list[str] = []

        async def one(session: aiohttp.ClientSession, key: str, i: int) -> None:
            body = {
                "model": MODEL,
                "prompt": f"{key} {i}",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            headers = {"Authorization": f"Bearer key-{key}"}
            async with session.post(
                f"{system.base}/v1/completions", json=body, headers=headers
            ) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["usage"]["completion_tokens"] == max_tokens
            finished.append(key)

        async with aiohttp.ClientSession() as session:
            # Sent in key order (a's first): FIFO would serve most of a's first.
            tasks = [
                asyncio.create_task(one(session, key, i)) for key in WEIGHTS for i in range(per_key)
            ]
            await asyncio.wait_for(asyncio.gather(*tasks), 180)
    # Equal requests: token shares are request shares. In the first 2 * per_key to finish, c
    # (half of them) has not run out, and neither have a and b. Within one request of the exact
    # share: two seats finish side by side, so the cut at 2 * per_key can fall between two
    # requests of one step (it failed once with a, b, c at 8, 9, 15). Equal weights (10-11 each)
    # or FIFO (a and b first) still fail it.
    counts = Counter(finished[: per_key * 2])
    for key, share in SHARES.items():
        assert abs(counts[key] - share * per_key * 2) <= 1, (counts, finished)


@pytest.mark.slow
async def test_an_urgent_request_takes_a_seat_from_less_urgent_work_at_once() -> None:
    """Both seats are held by long priority-9 requests and more wait behind them: a priority-0
    request is read by the full worker, which preempts a priority-9 sequence for it; it finishes
    while the priority-9 work is still running."""
    with running_system(("uw1",), ("--max-num-seqs", "2")) as system:
        worker = system.workers[0]
        async with aiohttp.ClientSession() as session:

            async def complete(priority: int, max_tokens: int) -> tuple[float, float]:
                body = {
                    "model": MODEL,
                    "prompt": "hi",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "priority": priority,
                }
                start = time.monotonic()
                async with session.post(f"{system.base}/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                return start, time.monotonic()

            slow = [asyncio.create_task(complete(9, 1500)) for _ in range(4)]
            while worker.metric("jitney_requests_running") < 2:
                await asyncio.sleep(0.05)
            preempted = worker.metric("jitney_preemptions_total")
            start, end = await asyncio.wait_for(complete(0, 4), 30)
            assert not any(task.done() for task in slow)  # the priority-9 work still runs
            assert end - start < 2.0
            assert worker.metric("jitney_preemptions_total") > preempted
            for task in slow:
                task.cancel()


@pytest.mark.slow
async def test_interactive_ttft_over_a_running_batch_of_500_lines() -> None:
    """A 500-line batch fills every seat; interactive requests meanwhile get their first token
    within 2x of their TTFT on the idle system plus 8 of the batch's steps, and the batch answers
    every line once. Read behind the queued lines, a request waits for a seat: a line's 48 steps
    or so. Lines sent at priority 0 took it to 87-129 ms against 8-10 ms idle, with steps of
    1.1-1.7 ms (this bound: 25-31 ms); the right order measured 8-11 ms. The steps' allowance
    is for a test beside this one on 2 cores, which slows only the loaded half: under CI's
    parallel tests the right order once took 28.3 ms against 12.2 ms idle, with steps of 3.2."""
    flags = ("--max-num-seqs", "8")
    with running_system(("bw1",), flags, gateway_flags=("--batch-max-queued", "8")) as system:
        worker = system.workers[0]

        async def ttft(session: aiohttp.ClientSession) -> float:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
            start = time.monotonic()
            async with session.post(f"{system.base}/v1/completions", json=body) as response:
                assert response.status == 200
                async for raw in response.content:
                    line = raw.decode().strip()
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        first = time.monotonic() - start
                        break
                await response.read()
            return first

        async def p50(session: aiohttp.ClientSession, n: int = 15) -> float:
            samples = []
            for _ in range(n):
                samples.append(await ttft(session))
                await asyncio.sleep(0.05)
            return statistics.median(samples)

        client = openai.OpenAI(base_url=f"{system.base}/v1", api_key="unused", max_retries=0)
        lines: list[dict[str, Any]] = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": f"{i}", "max_tokens": 48, "ignore_eos": True},
            }
            for i in range(500)
        ]
        async with aiohttp.ClientSession() as session:
            await p50(session, 5)  # warm-up: the interactive queue's path is made
            idle = await p50(session)
            file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            batch = client.batches.create(
                input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
            )
            while worker.metric("jitney_requests_running") < 8:
                await asyncio.sleep(0.05)
            steps = _step_totals(worker)
            loaded = await p50(session)
            step_s = _mean_step_since(worker, steps)
            running = client.batches.retrieve(batch.id)  # measured over the batch, not after it
            assert running.status == "in_progress" and running.request_counts.completed < 400
        ms = f"{loaded * 1000:.1f} ms over the batch, {idle * 1000:.1f} ms idle"
        ms += f", steps of {step_s * 1000:.1f} ms"
        assert loaded <= 2 * idle + 8 * step_s, f"interactive TTFT p50: {ms}"
        done = await asyncio.to_thread(wait_completed, client, batch.id, 300)
        assert done.request_counts.completed == 500 and done.request_counts.failed == 0
        out = output_lines(client, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)


def _step_totals(worker: Worker) -> tuple[float, float]:
    """The worker's step-duration histogram so far: (seconds, steps)."""
    name = "jitney_step_duration_seconds"
    return worker.metric(f"{name}_sum"), worker.metric(f"{name}_count")


def _mean_step_since(worker: Worker, before: tuple[float, float]) -> float:
    seconds, steps = (now - then for now, then in zip(_step_totals(worker), before, strict=True))
    assert steps > 0, "the batch ran no step while the interactive requests were timed"
    return seconds / steps
