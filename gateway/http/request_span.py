"""The HTTP request's span, outermost middleware when tracing is on (none when it is off).

A POST gets a SERVER span named `POST <route>`, a child of the client's `traceparent` when it
sent one (as vLLM honours it), else the root of a new trace; the request path's spans nest
under it (gateway.serving.tracing) and it ends when the response does, a stream's last byte
included, with its status. GETs (probes, /metrics, the live view) are not traced: they would
bury the requests in noise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.serving import tracing
from protocol.tracing import extract

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_CLOSED = 499  # as gateway.http.middleware counts a client gone mid-request


def request_span_middleware(gateway_id: str) -> Middleware | None:
    """The middleware, or None when tracing is off (nothing joins the chain)."""
    tracer = tracing.configure(gateway_id)
    if tracer is None:
        return None
    from opentelemetry.trace import SpanKind, Status, StatusCode

    @web.middleware
    async def request_span(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST":
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        status = 500
        with tracer.start_as_current_span(
            f"POST {route}",
            context=extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": route},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                response = await handler(request)
                status = response.status
                return response
            except asyncio.CancelledError:
                status = CLIENT_CLOSED
                raise
            finally:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))

    return request_span
