"""Tracing's shared parts: whether a process exports spans, its tracer, and the W3C trace
context a request message carries from the gateway to the worker.

Tracing is on when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set
(and neither OTEL_SDK_DISABLED=true nor OTEL_TRACES_EXPORTER=none says otherwise). Off,
`make_tracer` returns None and imports nothing of the SDK: the gateway and the worker check that
None once and build no span object at all. On, spans go out over OTLP/HTTP (protobuf) from a
batch processor's thread; the SDK and its exporter read the other OTEL_* variables themselves
(headers, timeout, compression, sampler, batch sizes, resource attributes).

The carrier is the W3C `traceparent` (and `tracestate`, when there is one): only the trace
context, never baggage, so nothing a client sends beyond ids reaches Redis.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

log = logging.getLogger("jitney.tracing")

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
HTTP_PROTOBUF = "http/protobuf"
RESOURCE_VAR = "OTEL_RESOURCE_ATTRIBUTES"
GATEWAY_SERVICE, WORKER_SERVICE = "jitney-gateway", "jitney-worker"
TRACER_NAME = "jitney"
_providers: list[Any] = []  # the SDK providers this process made (flush() empties their queues)
# What the carrier holds (W3C Trace Context); anything else in a message's field is ignored.
CARRIER_KEYS = ("traceparent", "tracestate")


def tracing_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process exports spans: an OTLP endpoint is set and tracing not disabled."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARS)


def make_tracer(service: str, instance_id: str | None = None) -> Tracer | None:
    """This process's tracer exporting over OTLP/HTTP, or None when tracing is off. The service
    name is `service` unless OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES)
    names one; service.instance.id is `instance_id` unless OTEL_RESOURCE_ATTRIBUTES names one.
    The provider flushes what it holds when the process exits (atexit)."""
    if not tracing_enabled():
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    for name in PROTOCOL_VARS:
        protocol = os.environ.get(name, "").strip()
        if protocol and protocol != HTTP_PROTOBUF:
            log.warning("%s=%s is not supported: exporting with %s", name, protocol, HTTP_PROTOBUF)
            break
    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    ours: dict[str, str] = {}
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        ours[SERVICE_NAME] = service
    # The SDK makes up a UUID for an instance not named in OTEL_RESOURCE_ATTRIBUTES: ours
    # (the worker's or gateway's id) says which process it is.
    if instance_id and f"{SERVICE_INSTANCE_ID}=" not in os.environ.get(RESOURCE_VAR, ""):
        ours[SERVICE_INSTANCE_ID] = instance_id
    provider = TracerProvider(resource=resource.merge(Resource(ours)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _providers.append(provider)
    log.info("tracing on: OTLP/HTTP export, service %s", provider.resource.attributes[SERVICE_NAME])
    return provider.get_tracer(TRACER_NAME)


def flush(timeout_ms: int = 30_000) -> bool:
    """Export every span ended so far now (what exit does anyway); True when all went out."""
    return all(provider.force_flush(timeout_ms) for provider in _providers)


def is_sampled(context: Context) -> bool:
    """Whether the span in `context` is sampled (its W3C flags say so)."""
    from opentelemetry.trace import get_current_span

    return get_current_span(context).get_span_context().trace_flags.sampled


def inject(context: Context | None = None) -> dict[str, str] | None:
    """The W3C headers of `context` (the current one by default), None without a valid span."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context)
    return carrier or None


def extract(carrier: Mapping[str, Any] | None) -> Context | None:
    """The remote parent in `carrier` (a message's field or HTTP headers), None when it holds
    no valid traceparent. Anything but strings under the W3C names is ignored: the field comes
    off the wire and a malformed one must not fail the request."""
    if not isinstance(carrier, Mapping):
        return None
    clean = {k: v for k in CARRIER_KEYS if isinstance(v := carrier.get(k), str)}
    if "traceparent" not in clean:
        return None
    from opentelemetry.trace import get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract(clean)
    return context if get_current_span(context).get_span_context().is_valid else None
