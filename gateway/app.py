"""The aiohttp application: routes, the error/metrics middleware, start-up and shutdown.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (process up,
always 200), GET /ready (Redis answers and a worker heartbeat is fresh, else 503), GET /metrics.
Every error is an OpenAI error body; an unexpected exception is logged and answered with a bare
500 (no details), and a Redis failure with a 503: bad input or a Redis outage never crashes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.errors import ApiError, internal_error, redis_unavailable
from gateway.generate import GATEWAY, chat_completions, completions
from gateway.service import Gateway
from jitney.protocol import HEARTBEAT_TTL_S

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", for the metrics label


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _from_http_exception(e: web.HTTPException) -> ApiError:
    if e.status == 413:
        return ApiError(413, "The request body is too large.", code="request_too_large")
    if e.status == 404:
        return ApiError(404, "No such route.", code="not_found")
    if e.status == 405:
        return ApiError(405, "Method not allowed on this route.", code="method_not_allowed")
    return ApiError(e.status, e.reason or "HTTP error.")


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[GATEWAY].metrics
    metrics.http_in_flight.inc()
    status = 500
    try:
        try:
            response = await handler(request)
        except ApiError as e:
            response = e.response()
        except web.HTTPException as e:
            response = _from_http_exception(e).response()
        except RedisError as e:
            log.warning("redis error route=%s error=%s: %s", _route(request), type(e).__name__, e)
            response = redis_unavailable().response()
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        except Exception:
            log.exception("unhandled error route=%s", _route(request))
            response = internal_error().response()
        status = response.status
        return response
    finally:
        metrics.http_in_flight.dec()
        metrics.http_requests.labels(_route(request), str(status)).inc()


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        async with asyncio.timeout(gw.config.redis_timeout_s):
            await gw.redis.ping()
            live = await gw.redis.zcount(gw.keys.workers, time.time() - HEARTBEAT_TTL_S, "+inf")
    except (RedisError, OSError, TimeoutError):
        return web.json_response({"status": "not_ready", "reason": "redis unavailable"}, status=503)
    if live == 0:
        reason = f"no worker heartbeat within {HEARTBEAT_TTL_S:g} s"
        return web.json_response({"status": "not_ready", "reason": reason}, status=503)
    return web.json_response(
        {"status": "ready", "workers": live, "reply_reader": gw.router.healthy}
    )


async def list_models(request: web.Request) -> web.Response:
    models = await request.app[GATEWAY].registry.live_models()
    data = [
        {
            "id": m.name,
            "object": "model",
            "created": int(m.card.created),
            "owned_by": "jitney",
            "max_model_len": m.card.max_model_len,
        }
        for m in models
    ]
    return web.json_response({"object": "list", "data": data})


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        backlog = await gw.backlog.reading()
        gw.metrics.queue_lag.set(backlog.lag)
        gw.metrics.queue_pending.set(backlog.pending)
    except (RedisError, OSError):
        pass  # keep the last values: /metrics must answer while Redis is down
    gw.metrics.queued_prompt_tokens.set(gw.router.queued_prompt_tokens)
    return web.Response(body=gw.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(config: GatewayConfig, gateway: Gateway | None = None) -> web.Application:
    """Serve it with `handler_cancellation=True` (run() does) so a client disconnect cancels
    the handler, which then publishes the cancel."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[errors_and_metrics])
    app[GATEWAY] = gateway or Gateway(config)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await app[GATEWAY].start()
        yield
        await app[GATEWAY].stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


def run(config: GatewayConfig) -> None:
    web.run_app(
        make_app(config),
        host=config.host,
        port=config.port,
        handler_cancellation=True,
        access_log=None,  # request lines are noise at scale; metrics count them
        print=None,
        shutdown_timeout=10.0,
    )
