"""The per-step Lua scripts go by SHA (EVALSHA), and still run after Redis restarts empty."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from gateway.serving.backlog import BacklogMonitor
from protocol import WORKER_GROUP, Keys, ModelCard, ReplyMessage, decode_replies
from tests.service.helpers import MODEL
from tests.services import RedisServer
from worker.redis_io import Outbox, PublishResult, WorkerRedis

KEYS = Keys()
REQUESTS = KEYS.requests(MODEL)
QUEUED_TOKENS = KEYS.queued_tokens(MODEL)
CARD = ModelCard("tiny", 64, [0], "{}")


def restart_empty(server: RedisServer) -> None:
    """No persistence: data, script cache and command statistics are all gone."""
    server.stop()
    server.start()


def script_calls(r: redis.Redis) -> tuple[int, int, int]:
    """(EVAL calls, EVALSHA calls, EVALSHA calls refused with NOSCRIPT) since the server
    started (Redis 7 counts a refused call in both `calls` and `failed_calls`)."""
    stats = r.info("commandstats")
    evalsha = stats["cmdstat_evalsha"]
    return stats.get("cmdstat_eval", {}).get("calls", 0), evalsha["calls"], evalsha["failed_calls"]


def publish_reply(io: WorkerRedis, seq: int) -> PublishResult:
    reply = ReplyMessage("cmpl-1", seq, token_ids=[seq])
    return io.publish(Outbox(replies=[(KEYS.replies("gw"), reply)]))


def test_worker_scripts_survive_a_redis_restart(redis_server):
    """Heartbeat and publish work before and after a restart that emptied the script cache,
    the card lost with the data is republished, and no call ever sends the script source."""
    r = redis_server.client()
    io = WorkerRedis(redis_server.client(), KEYS, "w1", MODEL)
    assert io.heartbeat(CARD) and publish_reply(io, 0) is PublishResult.APPLIED
    restart_empty(redis_server)
    assert not r.exists(KEYS.model(CARD.name))
    assert io.heartbeat(CARD)  # NOSCRIPT -> SCRIPT LOAD -> EVALSHA, inside redis-py
    assert r.exists(KEYS.model(CARD.name)) and r.zscore(KEYS.workers, "w1") is not None
    assert publish_reply(io, 1) is PublishResult.APPLIED
    # The restart emptied the reply stream: only the second reply is there.
    entries = r.xrange(KEYS.replies("gw"))
    assert [reply.seq for _, f in entries for reply in decode_replies(f)] == [1]
    # Each script: one EVALSHA refused (empty cache), SCRIPT LOAD, one EVALSHA that ran.
    assert script_calls(r) == (0, 4, 2)


def test_fenced_worker_scripts_refuse_after_a_restart(redis_server):
    """The scripts still check the fence once reloaded: a fenced worker neither renews its
    lease nor writes a reply."""
    r = redis_server.client()
    io = WorkerRedis(redis_server.client(), KEYS, "w1", MODEL)
    assert io.heartbeat(CARD)
    restart_empty(redis_server)
    r.set(KEYS.fenced("w1"), 1)
    assert not io.heartbeat(CARD)
    assert r.zscore(KEYS.workers, "w1") is None
    assert publish_reply(io, 0) is PublishResult.FENCED
    assert not r.exists(KEYS.replies("gw"))


async def test_backlog_counter_reset_survives_a_redis_restart(redis_server):
    """The gateway's backlog reading (a script that also resets the queued-token count when
    nothing is queued) heals a stale count after a restart emptied the script cache, called by
    SHA."""
    r = redis_server.client()
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=5)
    try:
        monitor = BacklogMonitor(client, KEYS, MODEL, max_queued_tokens=100, cache_s=0)
        r.set(QUEUED_TOKENS, 7)
        assert (await monitor.reading()).queued_tokens == 0
        assert int(r.get(QUEUED_TOKENS)) == 0
        restart_empty(redis_server)
        # The pooled connection died with the server (the gateway's callers retry that error);
        # drop it, so what follows tests the script cache alone.
        await client.connection_pool.disconnect()
        r.xgroup_create(REQUESTS, WORKER_GROUP, id="0", mkstream=True)
        r.set(QUEUED_TOKENS, 5)
        assert (await monitor.reading()).queued_tokens == 0
        assert int(r.get(QUEUED_TOKENS)) == 0
        assert script_calls(r) == (0, 2, 1)
    finally:
        await client.aclose()
