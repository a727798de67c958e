"""Prefix-aware placement's queue scripts on a real Redis, both ends played by their own code:
gateways place (BacklogMonitor.place), workers read and publish (WorkerRedis). No model."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter

from gateway.serving.backlog import BacklogMonitor
from gateway.serving.placement import OUTCOMES
from generation.block_hash import prompt_block_hashes, summary_hash
from protocol import Keys, ModelCard, RequestMessage
from protocol.queue import Queue, encode_entry, entry_cost
from protocol.queue.placement import (
    ADAPTERS_FIELD,
    BLOCK_SIZE_FIELD,
    ROOM_FIELD,
    WAITING_FIELD,
    SummaryUpdate,
    adapters_value,
)
from tests.service.helpers import MODEL
from worker.redis_io import STEAL_CHECK_S, EntryRef, Outbox, PublishResult, WorkerRedis

KEYS = Keys()
CARD = ModelCard(MODEL, 64, [0], "{}")
BLOCK = 4
STEAL_MS = 300


def message(request_id: str, prompt: list[int], lora: str | None = None) -> RequestMessage:
    reply_to = KEYS.replies("gw")
    return RequestMessage(request_id, MODEL, prompt, {}, reply_to, "gw", time.time(), lora=lora)


def worker(server, worker_id: str) -> WorkerRedis:
    """A worker's Redis side with placement on, joined, with a summary (the heartbeat)."""
    io = WorkerRedis(server.client(), KEYS, worker_id, MODEL, True, STEAL_MS)
    io.join_placement(BLOCK)
    assert io.heartbeat(CARD)
    return io


def summarize(
    io: WorkerRedis,
    prompt: list[int],
    room: int = 4,
    waiting: int = 0,
    adapters: tuple[str, ...] = (),
) -> None:
    """What the worker's publish sends once it has computed `prompt` (its full blocks), with
    `adapters` resident."""
    hashes = [summary_hash(h) for h in prompt_block_hashes(prompt, BLOCK)]
    load: dict[str, int | str] = {ROOM_FIELD: room, WAITING_FIELD: waiting}
    load |= {BLOCK_SIZE_FIELD: BLOCK, ADAPTERS_FIELD: adapters_value(adapters)}
    update = SummaryUpdate(io.summary_key, 5000, reset=True, added=hashes, load=load)
    assert io.publish(Outbox(summary=update)) is PublishResult.APPLIED


@pytest.fixture
async def monitor(redis_server) -> AsyncIterator[BacklogMonitor]:
    """A gateway's enqueueing side for MODEL, placement on, counting into its own registry."""
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=5)
    registry = CollectorRegistry()
    placements = Counter("placements", "", ["model", "outcome"], registry=registry)
    try:
        backlog = BacklogMonitor(client, KEYS, MODEL, placements=placements)
        backlog.registry = registry  # type: ignore[attr-defined]  # what `outcomes` reads
        yield backlog
    finally:
        await client.aclose()


def outcomes(monitor: BacklogMonitor) -> dict[str, float | None]:
    registry = monitor.registry  # type: ignore[attr-defined]
    return {
        o: registry.get_sample_value("placements_total", {"model": MODEL, "outcome": o})
        for o in OUTCOMES
    }


async def test_a_conversation_is_placed_on_the_worker_holding_it(redis_server, monitor):
    """LOOKUP finds the worker whose summary holds the prompt's leading blocks and PLACE puts
    the entry in its own stream; a prompt nobody holds goes to the shared stream."""
    w1, w2 = worker(redis_server, "w1"), worker(redis_server, "w2")
    history = list(range(10, 30))  # 5 full blocks
    summarize(w1, history)
    summarize(w2, [])
    turn = message("turn-2", [*history, 40, 41, 42])
    stream, _ = await monitor.place(turn, Queue(), cost=30)
    assert stream == KEYS.requests(MODEL, worker="w1")
    stream, _ = await monitor.place(message("new", list(range(100, 120))), Queue(), cost=30)
    assert stream == KEYS.requests(MODEL)
    assert outcomes(monitor) == {"hit": 1, "no_hit": 1, "busy": 0, "adapter": 0}
    # w2 reads only the shared entry; w1, its own
    assert [e.queue for e in w2.read_requests(4, None)] == [KEYS.requests(MODEL)]
    own = w1.read_requests(4, None)
    assert [e.queue for e in own] == [KEYS.requests(MODEL, worker="w1")]
    assert w1.placement_outcome(own[0].queue) == "own"


async def test_a_request_under_an_adapter_goes_to_a_worker_holding_it(redis_server, monitor):
    """LOOKUP finds the adapter in the summaries' adapter field: a prompt shorter than a block
    is placed on the worker holding it resident, never on one holding only a name it contains;
    an adapter every worker holds places as the base model does."""
    w1, w2 = worker(redis_server, "w1"), worker(redis_server, "w2")
    summarize(w1, [], adapters=("sql-v2", "chat"))
    summarize(w2, [], adapters=("sql",))
    stream, _ = await monitor.place(message("s", [1, 2], lora="sql"), Queue(), cost=2)
    assert stream == KEYS.requests(MODEL, worker="w2")
    stream, _ = await monitor.place(message("c", [1, 2], lora="chat"), Queue(), cost=2)
    assert stream == KEYS.requests(MODEL, worker="w1")
    summarize(w2, [], adapters=("chat", "sql"))
    stream, _ = await monitor.place(message("c2", [1, 2], lora="chat"), Queue(), cost=2)
    assert stream == KEYS.requests(MODEL)
    assert outcomes(monitor) == {"hit": 0, "no_hit": 1, "busy": 0, "adapter": 2}


async def test_a_busy_holder_gets_no_short_hit(redis_server, monitor):
    """Its summary says no room while another worker has some: the shared stream."""
    w1, w2 = worker(redis_server, "w1"), worker(redis_server, "w2")
    history = list(range(10, 30))
    summarize(w1, history[:8], room=0)  # 2 of the 6 blocks of the next turn
    summarize(w2, [], room=3)
    stream, _ = await monitor.place(message("t", [*history, 1, 2, 3, 4]), Queue(), cost=30)
    assert stream == KEYS.requests(MODEL)
    assert outcomes(monitor)["busy"] == 1
    assert [e.queue for e in w2.read_requests(4, None)] == [KEYS.requests(MODEL)]
    assert w1.read_requests(4, None) == []


async def test_the_owner_reads_its_own_and_the_shared_stream_oldest_first(redis_server, monitor):
    w1, w2 = worker(redis_server, "w1"), worker(redis_server, "w2")
    history = list(range(10, 30))
    summarize(w1, history)
    summarize(w2, [])
    placed = [
        await monitor.place(message(name, prompt), Queue(), cost=30)
        for name, prompt in [("a", [1] * 20), ("b", history), ("c", [2] * 20), ("d", history)]
    ]
    assert [stream for stream, _ in placed].count(KEYS.requests(MODEL, worker="w1")) == 2
    got = w1.read_requests(4, None)
    assert [e.entry_id for e in got] == [entry_id for _, entry_id in placed]


async def test_another_worker_takes_an_entry_its_owner_left_past_the_bound(redis_server, monitor):
    """Not before the bound (the read says when to look again), at once after it."""
    w1, w2 = worker(redis_server, "w1"), worker(redis_server, "w2")
    history = list(range(10, 30))
    summarize(w1, history)
    summarize(w2, [])
    stream, entry_id = await monitor.place(message("t", history), Queue(), cost=30)
    assert stream == KEYS.requests(MODEL, worker="w1")
    assert w2.read_requests(4, None) == []
    assert 0 < w2._steal_at - time.monotonic() <= STEAL_MS / 1000
    time.sleep(STEAL_MS / 1000 + 0.05)
    got = w2.read_requests(4, None)
    assert [(e.queue, e.entry_id) for e in got] == [(stream, entry_id)]
    assert w2.placement_outcome(stream) == "stolen"
    assert w1.read_requests(4, None) == []  # delivered once


async def test_a_leaving_worker_s_entries_are_taken_at_once_and_its_empty_stream_dropped(
    redis_server, monitor
):
    r = redis_server.client()
    w1, w2 = worker(redis_server, "w1"), worker(redis_server, "w2")
    history = list(range(10, 30))
    summarize(w1, history)
    summarize(w2, [])
    stream, entry_id = await monitor.place(message("t", history), Queue(), cost=30)
    w1.withdraw_summary()  # SIGTERM: no more placements, and what waits is anyone's
    assert [e.entry_id for e in w2.read_requests(4, None)] == [entry_id]
    assert w2.publish(Outbox(acks=[EntryRef(stream, entry_id)])) is PublishResult.APPLIED  # served
    time.sleep(STEAL_CHECK_S)  # the next look at others' streams finds it empty: dropped
    assert w2.read_requests(4, None) == []
    assert r.zscore(KEYS.queues(MODEL), stream) is None and not r.exists(stream)
    assert not r.hexists(KEYS.queue_owners(MODEL), stream)
    # placed on a worker whose summary is gone by then: the shared stream
    assert monitor.placement is not None
    fields = encode_entry(message("late", history), 30)
    assert (await monitor.placement.place("w1", Queue(), fields, 20))[0] == KEYS.requests(MODEL)


async def test_fair_share_charges_and_refunds_the_queue_not_the_own_stream(redis_server, monitor):
    """Two weighted queues of one priority (the round robin runs): an entry read from a worker's
    own stream of one of them is charged to that queue, and its refund returns there."""
    r = redis_server.client()
    w1, w2 = worker(redis_server, "w1"), worker(redis_server, "w2")
    history = list(range(10, 30))
    summarize(w1, history)
    summarize(w2, [])
    tenant_a, tenant_b = Queue(0, "a", 1), Queue(0, "b", 1)
    await monitor.place(message("b1", [3] * 8), tenant_b, cost=50)
    for name in ("a1", "a2"):
        stream, _ = await monitor.place(message(name, history), tenant_a, cost=50)
        assert stream == tenant_a.stream(KEYS, MODEL, "w1")
    got = w1.read_requests(2, None)  # one round: one entry of each queue
    assert {e.queue for e in got} == {stream, tenant_b.stream(KEYS, MODEL)}
    base = tenant_a.stream(KEYS, MODEL)
    deficits = {k.decode(): int(v) for k, v in r.hgetall(KEYS.queue_deficits(MODEL)).items()}
    assert stream not in deficits and deficits[base] == 1 - 50  # a quantum of 1, then a charge
    placed = next(e for e in got if e.queue == stream)
    assert w1.queue_of(stream) == base
    assert (
        w1.publish(Outbox(refunds=[(stream, entry_cost(placed.fields))])) is PublishResult.APPLIED
    )
    assert int(r.hget(KEYS.queue_deficits(MODEL), base)) == 0  # refunded, never past 0


def test_the_summary_s_changes_ride_on_the_publish_and_a_lost_one_asks_to_be_resent(
    redis_server,
):
    r = redis_server.client()
    io = worker(redis_server, "w1")
    key = io.summary_key
    added = [b"12345678", b"abcdefgh"]
    update = SummaryUpdate(key, 5000, reset=True, added=added, load={"room": 2})
    assert io.publish(Outbox(summary=update)) is PublishResult.APPLIED
    assert r.hgetall(key) == {b"12345678": b"", b"abcdefgh": b"", b"room": b"2"}
    assert 4000 < r.pttl(key) <= 5000
    update = SummaryUpdate(key, 5000, removed=[b"12345678"], load={"waiting": 1})
    assert io.publish(Outbox(summary=update)) is PublishResult.APPLIED
    assert r.hgetall(key) == {b"abcdefgh": b"", b"room": b"2", b"waiting": b"1"}
    r.pexpire(key, 100)
    assert io.heartbeat(CARD) and r.pttl(key) > 4000  # renewed with the lease
    r.delete(key)  # Redis lost it: a partial summary is not rebuilt from changes
    lost = io.publish(Outbox(summary=SummaryUpdate(key, 5000, added=[b"zzzzzzzz"])))
    assert lost is PublishResult.SUMMARY_LOST
    assert not r.exists(key)
