"""A minimal OTLP/HTTP trace receiver: `POST /v1/traces` protobuf bodies, decoded with
opentelemetry-proto into plain `ReceivedSpan`s (what a collector, Jaeger or Tempo would store).

The tracing test points a real gateway and worker at it; `research/tracing_cost.py` runs it as a
process of its own (`python -m tests.otlp_receiver --port N`), so that what the worker measures
is its own export and not the receiver's decoding (`GET /` answers the counts so far). Gzip
bodies are accepted (OTEL_EXPORTER_OTLP_COMPRESSION=gzip).
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True, slots=True)
class ReceivedEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    resource: dict[str, Any]
    name: str
    kind: int  # opentelemetry.proto's Span.SpanKind: 1 internal, 2 server, 4 producer, 5 consumer
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[ReceivedEvent, ...] = ()


def value(any_value: AnyValue) -> Any:
    """An attribute's value as Python: str, bool, int, float, bytes or a list of them."""
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return attributes(any_value.kvlist_value.values)
    return None if kind is None else getattr(any_value, kind)


def attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


def decode(body: bytes) -> list[ReceivedSpan]:
    """Every span of one export request."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            spans.extend(_span(s, resource) for s in scope_spans.spans)
    return spans


def _span(span: Span, resource: dict[str, Any]) -> ReceivedSpan:
    events = tuple(
        ReceivedEvent(e.name, e.time_unix_nano, attributes(e.attributes)) for e in span.events
    )
    return ReceivedSpan(
        service=str(resource.get("service.name", "")),
        resource=resource,
        name=span.name,
        kind=span.kind,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        status_code=span.status.code,
        attributes=attributes(span.attributes),
        events=events,
    )


class OtlpReceiver:
    """Listens on 127.0.0.1:`port` (0: a free one) in a thread; `spans` grows as exports come.
    A body that does not decode is answered 400 and counted in `bad_requests`."""

    def __init__(self, port: int = 0):
        self.spans: list[ReceivedSpan] = []
        self.bad_requests = 0
        self.num_exports = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding", "") == "gzip":
                    body = gzip.decompress(body)
                try:
                    if self.path != TRACES_PATH:
                        raise ValueError(f"no route {self.path}")
                    spans = decode(body)
                except Exception:
                    with receiver._lock:
                        receiver.bad_requests += 1
                    self.send_response(404 if self.path != TRACES_PATH else 400)
                    self.end_headers()
                    return
                receiver.add(spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def do_GET(self) -> None:
                """What it has received so far, as JSON (the bench reads it)."""
                with receiver._lock:
                    counts = {"spans": len(receiver.spans), "exports": receiver.num_exports}
                reply = json.dumps(counts).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: a test's output is its failures

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT takes (the exporter adds /v1/traces)."""
        return f"http://127.0.0.1:{self.port}"

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.spans.extend(spans)
            self.num_exports += 1

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    with OtlpReceiver(args.port) as receiver:
        print(f"listening {receiver.endpoint}", flush=True)
        receiver.thread.join()


if __name__ == "__main__":
    main()
