"""Serving the app: the API port (and --metrics-port), the drain on SIGTERM, and malformed HTTP.

A malformed HTTP request (bad request line, header line over the limit, too many headers) never
reaches a handler or the middleware: GatewayRunner answers it with an OpenAI error body too
(400 or 431).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.app_state import GATEWAY
from gateway.config import GatewayConfig
from gateway.http.app import make_app, make_metrics_app
from gateway.openai.errors import ApiError
from gateway.serving.gateway_state import Gateway

log = logging.getLogger(__name__)


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
