"""The gateway's spans: a request's parse, tokenize and enqueue, under the HTTP request's span
(gateway.http.request_span), and the trace context its queue entries carry to the worker.

`configure()` (once, when the app is made) decides: off (no OTLP endpoint set), `span` hands
back one shared null context and `carrier` None, so the request path builds no span object and
a message carries no context. On, the spans nest under the current one (contextvars follow the
handler's task), and `carrier` is the W3C context of the enqueue span the entry is sent in: the
worker's spans continue the trace from there.

Attributes hold ids, counts and names only, never prompt or output text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

from protocol.tracing import GATEWAY_SERVICE, inject, make_tracer

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

_tracer: Tracer | None = None
_configured = False
_OFF: AbstractContextManager[None] = nullcontext()

# Attribute names (OpenTelemetry's GenAI and messaging conventions where one fits).
MODEL = "gen_ai.request.model"
KIND = "jitney.request.kind"  # chat or completion
REQUEST_ID = "jitney.request.id"
STREAM = "messaging.destination.name"


def configure(gateway_id: str) -> Tracer | None:
    """This process's tracer (made on the first call, from the OTEL_* environment)."""
    global _tracer, _configured
    if not _configured:
        _tracer, _configured = make_tracer(GATEWAY_SERVICE, instance_id=gateway_id), True
    return _tracer


def span(
    name: str, kind: Literal["internal", "producer"] = "internal", **attributes: Any
) -> AbstractContextManager[Span | None]:
    """A child span of the current one for the block (None inside when tracing is off)."""
    if _tracer is None:
        return _OFF
    return _span(_tracer, name, kind, attributes)


@contextmanager
def _span(tracer: Tracer, name: str, kind: str, attributes: dict[str, Any]) -> Iterator[Span]:
    from opentelemetry.trace import SpanKind, Status, StatusCode

    span_kind = SpanKind.PRODUCER if kind == "producer" else SpanKind.INTERNAL
    # Not the SDK's exception event: its message may quote the request (a 400 names the value
    # it refused). The error's type only.
    with tracer.start_as_current_span(
        name, kind=span_kind, record_exception=False, set_status_on_exception=False
    ) as current:
        set_attributes(current, **attributes)
        try:
            yield current
        except Exception as e:
            current.set_attribute("error.type", type(e).__name__)
            current.set_status(Status(StatusCode.ERROR))
            raise


def enqueue_span(request_id: str) -> AbstractContextManager[Span | None]:
    """The span of one queue entry's XADD (a producer's: the worker's spans are its children);
    the caller adds the stream it went to."""
    return span(
        "jitney.enqueue", "producer", **{REQUEST_ID: request_id, "messaging.system": "redis"}
    )


def set_attributes(span: Span | None, **attributes: Any) -> None:
    """Set the attributes that are not None (nothing when `span` is None: tracing off)."""
    if span is not None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def annotate(**attributes: Any) -> None:
    """Set attributes on the current span (the request's, in a handler); nothing when off.
    Keyword names with dots go through a dict: `annotate(**{MODEL: name})`."""
    if _tracer is not None:
        from opentelemetry.trace import get_current_span

        set_attributes(get_current_span(), **attributes)


def carrier() -> dict[str, str] | None:
    """The current span's W3C context for a queue entry (None when off or outside a trace)."""
    return None if _tracer is None else inject()
