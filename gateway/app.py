"""The aiohttp application: routes, middleware, start-up and shutdown.

Routes: POST /v1/completions, POST /v1/chat/completions, the Batch API (/v1/files, /v1/batches:
gateway.batch_api; its runner task starts and stops with the app), GET /v1/models, GET /health
(process up, always 200), GET /ready (Redis answers and a worker heartbeat is fresh, else 503),
GET /metrics (on the main port, behind auth when keys are configured; or alone on
--metrics-port).
Middleware, outermost first: errors and metrics (every error is an OpenAI error body; an
unexpected exception is logged and answered with a bare 500, a Redis failure with a 503), auth
(401), body size (413 from Content-Length, before reading), rate limits (429).
A malformed HTTP request (bad request line, header line over the limit, too many headers) never
reaches a handler: GatewayRunner answers it with an OpenAI error body too (400 or 431).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway import batch_api
from gateway.auth import CLIENT, auth_middleware
from gateway.batch_api import MULTIPART_OVERHEAD, UPLOAD_PATH
from gateway.batch_runner import BatchRunner
from gateway.config import GatewayConfig
from gateway.errors import ApiError, internal_error, redis_unavailable
from gateway.generate import GATEWAY, chat_completions, completions
from gateway.live_view import setup_live_view
from gateway.ratelimit import RATE_LIMITER, RateLimiter, rate_limit_middleware
from gateway.service import Gateway
from protocol import HEARTBEAT_TTL_S, NOOP_MODEL

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BATCH_RUNNER: web.AppKey[BatchRunner] = web.AppKey("batch_runner", BatchRunner)
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", for the metrics label


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _from_http_exception(e: web.HTTPException) -> ApiError:
    if e.status == 413:
        return too_large()
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
        except Exception as e:
            # The type and the stack, not the message: it may quote a prompt.
            stack = "".join(traceback.format_tb(e.__traceback__))
            log.error(
                "unhandled error route=%s error=%s\n%s", _route(request), type(e).__name__, stack
            )
            response = internal_error().response()
        status = response.status
        return response
    finally:
        metrics.http_in_flight.dec()
        route = _route(request)
        metrics.http_requests.labels(route, str(status)).inc()
        client = request.get(CLIENT)
        key_id = client.key_id if client is not None else None
        if key_id is not None:
            metrics.api_key_requests.labels(key_id, str(status)).inc()
        log.debug("request route=%s status=%d key_id=%s", route, status, key_id or "-")


def body_limit(max_body_bytes: int, max_upload_bytes: int) -> Middleware:
    """413 from the Content-Length header alone: a body announced too large is never read
    (aiohttp's client_max_size still stops chunked bodies while reading). A file upload has its
    own, larger limit (streamed: the handler counts what it reads)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        upload = request.method == "POST" and request.path == UPLOAD_PATH
        if (request.content_length or 0) > (max_upload_bytes if upload else max_body_bytes):
            raise too_large()
        return await handler(request)

    return check


def too_large() -> ApiError:
    return ApiError(413, "The request body is too large.", code="request_too_large")


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
            "max_model_len": m.card.max_model_len,
        }
        for m in models
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
    batch_api.add_routes(app)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
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


# --- malformed HTTP: answered before routing, so the middleware never sees it ----------------


def _malformed(exc: BaseException, line_bytes: int, headers: int) -> ApiError:
    if isinstance(exc, LineTooLong):
        return ApiError(
            431,
            f"The request line or a header field is longer than {line_bytes} bytes.",
            code="header_too_large",
        )
    if isinstance(exc, HttpProcessingError) and "Too many headers" in exc.message:
        return ApiError(
            431, f"The request has more than {headers} header fields.", code="too_many_headers"
        )
    return ApiError(400, "Malformed HTTP request.", code="bad_http_request")


class _Protocol(RequestHandler):
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        # aiohttp's own answer is text quoting the offending line, and its log line too (an
        # over-long Authorization header would put a key in the log): neither, here.
        log.debug("malformed HTTP request from %s: %s", request.remote, type(exc).__name__)
        response = _malformed(exc, self.max_line_size, self.max_headers).response()
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose connections answer malformed HTTP with OpenAI error bodies."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # same object, our protocol factory
        return server


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set): the API on config.port and, with
    --metrics-port, /metrics on its own port."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = make_app(config)
    options: dict[str, Any] = {
        "handler_cancellation": True,
        "access_log": None,  # request lines are noise at scale; metrics count them
        # What is still open after the drain below is cancelled at once (cancels published).
        "shutdown_timeout": 1.0,
        "max_line_size": config.max_header_line_bytes,
        "max_field_size": config.max_header_line_bytes,
        "max_headers": config.max_headers,
    }
    runners = [(GatewayRunner(app, **options), config.port)]
    if config.metrics_port is not None:
        metrics_app = make_metrics_app(app[GATEWAY])
        runners.append((GatewayRunner(metrics_app, **options), config.metrics_port))
    try:
        for runner, port in runners:
            await runner.setup()
            await web.TCPSite(runner, config.host, port).start()
        log.info(
            "listening on %s:%d%s",
            config.host,
            config.port,
            "" if config.metrics_port is None else f" (metrics on :{config.metrics_port})",
        )
        await stop.wait()
        await drain(app[GATEWAY])
    finally:
        for runner, _ in reversed(runners):
            await runner.cleanup()


async def drain(gw: Gateway) -> None:
    """Stop taking requests (503, /ready off) and give the open ones up to the shutdown timeout
    to finish, so a rolling update cuts no stream that could end in time."""
    gw.draining = True
    deadline = time.monotonic() + gw.config.shutdown_timeout_s
    if gw.active_requests:
        log.info(
            "draining in_flight=%d timeout_s=%g", gw.active_requests, gw.config.shutdown_timeout_s
        )
    while gw.active_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if gw.active_requests:
        log.warning("shutdown timeout: cancelling in_flight=%d", gw.active_requests)


def run(config: GatewayConfig) -> None:
    asyncio.run(serve(config))
