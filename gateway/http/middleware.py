"""The middleware, outermost first: errors and metrics (every error is an OpenAI error body; an
unexpected exception is logged and answered with a bare 500, a Redis failure with a 503), then
(in gateway.http.app's order) auth (401), body size (413 from Content-Length, before reading)
and rate limits (429)."""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from redis.exceptions import RedisError

from gateway.app_state import GATEWAY
from gateway.batch.routes import UPLOAD_PATH
from gateway.http.auth import CLIENT
from gateway.openai.errors import ApiError, internal_error, redis_unavailable

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
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
