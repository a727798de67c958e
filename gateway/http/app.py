"""The aiohttp application: its routes and middleware, and what starts and stops with it.

Routes: POST /v1/completions, POST /v1/chat/completions (gateway.http.completion_routes), the
Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}:
gateway.http.responses_routes), the
Batch API (/v1/files, /v1/batches: gateway.batch.routes; its runner task starts and stops with
the app), POST /v1/embeddings (gateway.http.embedding_routes), POST /tokenize, POST /detokenize
and GET /tokenizer_info (gateway.http.tokenize_routes), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (gateway.http.lora_routes: with --enable-lora-runtime-updates only),
GET /ui and /ui/events (gateway.http.live_view), GET /v1/models, GET /health (process up, always
200), GET /ready (Redis answers and a worker heartbeat is fresh, else 503), GET
/metrics (on the main port, behind auth when keys are configured; or alone on --metrics-port).
Middleware: gateway.http.middleware (and gateway.http.request_span with tracing on).
Serving it: gateway.http.server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway.app_state import GATEWAY
from gateway.batch import routes as batch_routes
from gateway.batch.line_runner import BatchRunner
from gateway.batch.routes import MULTIPART_OVERHEAD
from gateway.config import GatewayConfig
from gateway.http.auth import auth_middleware
from gateway.http.completion_routes import chat_completions, completions
from gateway.http.embedding_routes import add_routes as add_embedding_routes
from gateway.http.live_view import setup_live_view
from gateway.http.lora_routes import add_routes as add_lora_routes
from gateway.http.middleware import body_limit, errors_and_metrics
from gateway.http.ratelimit import RATE_LIMITER, RateLimiter, rate_limit_middleware
from gateway.http.request_span import request_span_middleware
from gateway.http.responses_routes import add_routes as add_responses_routes
from gateway.http.tokenize_routes import add_routes as add_tokenize_routes
from gateway.serving.gateway_state import Gateway
from gateway.serving.served_models import served_adapters
from protocol import HEARTBEAT_TTL_S, NOOP_MODEL

BATCH_RUNNER: web.AppKey[BatchRunner] = web.AppKey("batch_runner", BatchRunner)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if gw.draining:
        return web.json_response({"status": "not_ready", "reason": "shutting down"}, status=503)
    try:
        async with asyncio.timeout(gw.config.redis_timeout_s):
            # A key's round trip, not PING: on a cluster PING goes to every node, and a node
            # of another shard being down must not make this deployment unready.
            live = await gw.redis.zcount(gw.keys.workers, time.time() - HEARTBEAT_TTL_S, "+inf")
    except (RedisError, OSError, TimeoutError):
        return web.json_response({"status": "not_ready", "reason": "redis unavailable"}, status=503)
    if live == 0 and not gw.config.queue_without_workers:
        reason = f"no worker heartbeat within {HEARTBEAT_TTL_S:g} s"
        return web.json_response({"status": "not_ready", "reason": reason}, status=503)
    # Ready means a request would be served: the registry the request path reads has a model
    # (a worker's heartbeat can come before this gateway has read its model card).
    if live and not gw.config.queue_without_workers:
        try:
            async with asyncio.timeout(gw.config.redis_timeout_s):
                models = await gw.registry.live_models(miss=True)
        except (RedisError, OSError, TimeoutError):
            models = None
        if not models:
            reason = "no model card read yet" if models is not None else "redis unavailable"
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
            # `jitney worker --model noop` has no model: it must not pass for one.
            "owned_by": "jitney-noop (load testing only, no model)"
            if m.name == NOOP_MODEL
            else "jitney",
            "root": m.name,
            "parent": None,
            "max_model_len": m.card.max_model_len,
            # What a request that leaves these fields out gets (empty: the API's defaults).
            "sampling_defaults": m.sampling_defaults.to_dict(),
        }
        for m in models
    ]
    # Each LoRA adapter as a model of its own, its base as `parent` (vLLM's shape).
    data += [
        {
            "id": a.served_name,
            "object": "model",
            "created": int(a.card.created),
            "owned_by": "jitney",
            "root": a.root,
            "parent": a.name,
            "max_model_len": a.card.max_model_len,
            "sampling_defaults": a.sampling_defaults.to_dict(),
        }
        for a in served_adapters(models)
    ]
    return web.json_response({"object": "list", "data": data})


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        for model, backlog in (await gw.backlogs()).items():
            gw.metrics.queue_lag.labels(model).set(backlog.lag)
            gw.metrics.queue_pending.labels(model).set(backlog.pending)
    except (RedisError, OSError):
        pass  # keep the last values: /metrics must answer while Redis is down
    gw.metrics.queued_prompt_tokens.set(gw.router.queued_prompt_tokens)
    for priority, waiting in gw.router.waiting_by_priority.items():
        gw.metrics.waiting_requests.labels(str(priority)).set(waiting)
    return web.Response(body=gw.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(config: GatewayConfig, gateway: Gateway | None = None) -> web.Application:
    """Serve it with `handler_cancellation=True` (run() does) so a client disconnect cancels
    the handler, which then publishes the cancel."""
    gw = gateway or Gateway(config)
    middlewares = [
        errors_and_metrics,
        auth_middleware(config, gw.metrics),
        body_limit(config.max_body_bytes, config.max_file_bytes + MULTIPART_OVERHEAD),
    ]
    limiter = RateLimiter(gw.redis, gw.keys, gw.metrics) if config.rate_limited else None
    if limiter is not None:
        middlewares.append(rate_limit_middleware(limiter))
    request_span = request_span_middleware(config.gateway_id)  # None: tracing off
    if request_span is not None:  # outermost: its span covers the whole response
        middlewares.insert(0, request_span)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[GATEWAY] = gw
    if limiter is not None:
        app[RATE_LIMITER] = limiter

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await app[GATEWAY].start()
        app[BATCH_RUNNER].start()
        yield
        await app[BATCH_RUNNER].stop()
        await app[GATEWAY].stop()

    app[BATCH_RUNNER] = BatchRunner(gw)
    app.cleanup_ctx.append(lifecycle)
    batch_routes.add_routes(app)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    add_responses_routes(app)  # POST /v1/responses; GET, DELETE /v1/responses/{id}
    add_embedding_routes(app)  # POST /v1/embeddings
    add_tokenize_routes(app)  # POST /tokenize, /detokenize; GET /tokenizer_info
    add_lora_routes(app)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (admin keys)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    setup_live_view(app)  # GET /ui, /ui/events
    if config.metrics_port is None:
        app.router.add_get("/metrics", metrics)
    return app


def make_metrics_app(gateway: Gateway) -> web.Application:
    """/metrics alone, without auth: for --metrics-port, a port only Prometheus can reach."""
    app = web.Application(middlewares=[errors_and_metrics])
    app[GATEWAY] = gateway
    app.router.add_get("/metrics", metrics)
    return app
