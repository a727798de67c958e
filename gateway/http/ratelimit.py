"""Per-client rate limits: two token buckets in Redis, shared by every gateway replica.

One hash per client (`<prefix>:ratelimit:<bucket>`) holds both buckets: requests (refilled at
`rps`, capacity `burst`) and tokens (refilled at `tpm` per minute, capacity `tpm`). A Lua script
refills and charges them atomically, using Redis's own clock (TIME), so replicas with skewed
clocks still agree. A refused request charges nothing; its 429 says when the bucket will hold
enough (Retry-After, whole seconds, rounded up).

Requests are charged by the middleware on every /v1/ route; tokens (prompt + max_tokens) by
`charge_tokens`, which the generation handler calls once it knows both, before enqueueing.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.http.auth import CLIENT, Client
from gateway.openai.errors import ApiError, bad_request
from gateway.serving.gateway_metrics import GatewayMetrics
from protocol import Keys

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LIMITED_PREFIX = "/v1/"

# KEYS[1]: the client's hash. ARGV: rps, burst, tpm, requests wanted, tokens wanted.
# Returns {1, 0} when charged, or {0, milliseconds until both buckets hold what was wanted}.
_LUA = """
local rps, burst, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local want_r, want_t = tonumber(ARGV[4]), tonumber(ARGV[5])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000
local state = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local elapsed = math.max(now - (tonumber(state[3]) or now), 0)
local r = math.min(burst, (tonumber(state[1]) or burst) + elapsed * rps / 1000)
local t = math.min(tpm, (tonumber(state[2]) or tpm) + elapsed * tpm / 60000)
local wait = 0
if rps > 0 and r < want_r then wait = math.max(wait, (want_r - r) * 1000 / rps) end
if tpm > 0 and t < want_t then wait = math.max(wait, (want_t - t) * 60000 / tpm) end
if wait > 0 then return {0, math.ceil(wait)} end
if rps > 0 then r = r - want_r end
if tpm > 0 then t = t - want_t end
redis.call('HSET', KEYS[1], 'r', string.format('%.17g', r), 't', string.format('%.17g', t),
           'ts', string.format('%.17g', now))
local full_ms = 60000
if rps > 0 then full_ms = math.max(full_ms, burst * 1000 / rps) end
redis.call('PEXPIRE', KEYS[1], math.ceil(full_ms) + 1000)
return {1, 0}
"""


class RateLimiter:
    def __init__(self, redis: aioredis.Redis, keys: Keys, metrics: GatewayMetrics):
        self.keys = keys
        self.metrics = metrics
        # register_script: EVALSHA, and SCRIPT LOAD + EVALSHA again on NOSCRIPT (a restarted
        # Redis has an empty script cache).
        self._script = redis.register_script(_LUA)

    async def charge(self, client: Client, requests: int = 0, tokens: int = 0) -> None:
        """Take `requests` and `tokens` from the client's buckets, or raise a 429 (a 400 for a
        request larger than the token bucket itself, which no wait would let through)."""
        limits = client.limits
        if limits.tpm > 0 and tokens > limits.tpm:
            self.metrics.rejected.labels("rate_limit").inc()
            raise bad_request(
                f"This request needs {tokens} tokens (prompt + max_tokens), more than the "
                f"limit of {limits.tpm} tokens per minute; reduce the prompt or max_tokens.",
                param="max_tokens",
                code="tokens_over_rate_limit",
            )
        requests = requests if limits.rps > 0 else 0
        tokens = tokens if limits.tpm > 0 else 0
        if requests == 0 and tokens == 0:
            return
        args = [limits.rps, limits.burst, limits.tpm, requests, tokens]
        allowed, wait_ms = await self._script(keys=[self.keys.ratelimit(client.bucket)], args=args)
        if int(allowed) != 1:
            self.metrics.rejected.labels("rate_limit").inc()
            raise _limited(client, int(wait_ms), "tokens" if tokens else "requests")


def _limited(client: Client, wait_ms: int, what: str) -> ApiError:
    limits = client.limits
    limit = (
        f"{limits.tpm} tokens per minute"
        if what == "tokens"
        else f"{limits.rps:g} requests per second (burst {limits.burst})"
    )
    retry_after = max(1, math.ceil(wait_ms / 1000))
    return ApiError(
        429,
        f"Rate limit reached: {limit}; retry in {retry_after} s.",
        type="rate_limit_exceeded",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after)},
    )


RATE_LIMITER: web.AppKey[RateLimiter] = web.AppKey("jitney_rate_limiter", RateLimiter)


def rate_limit_middleware(limiter: RateLimiter) -> Middleware:
    """Charges one request to the client's bucket on every /v1/ route (invalid bodies too: a
    flood of bad requests is still a flood)."""

    @web.middleware
    async def limit(request: web.Request, handler: Handler) -> web.StreamResponse:
        client = request.get(CLIENT)
        if client is not None and request.path.startswith(LIMITED_PREFIX):
            await limiter.charge(client, requests=1)
        return await handler(request)

    return limit


async def charge_tokens(request: web.Request, tokens: int) -> None:
    """The generation handler's hook: charge prompt + max_tokens before enqueueing (429/400).
    A no-op when the gateway has no rate limits."""
    limiter = request.app.get(RATE_LIMITER)
    client = request.get(CLIENT)
    if limiter is not None and client is not None:
        await limiter.charge(client, tokens=tokens)
