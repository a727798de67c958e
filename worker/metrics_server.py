"""The worker's metrics port, bound before the model loads (a taken port is refused in a moment,
not after the seconds torch takes to import and the model to load); serving starts once the
engine and its metrics exist (worker/metrics.py). Until then a scrape waits in the socket's
backlog rather than being refused."""

from __future__ import annotations

from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds: no access log."""


def bind_metrics_port(port: int, addr: str = "0.0.0.0") -> ThreadingWSGIServer:
    """A server bound to `port` (0: any free one), its app set and its thread started by
    `WorkerMetrics.serve`. Raises OSError when the port is taken."""
    return make_server(addr, port, _not_ready, ThreadingWSGIServer, handler_class=QuietHandler)


def _not_ready(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """The app until `serve` replaces it (the server does not serve before then)."""
    start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
    return [b"starting\n"]
