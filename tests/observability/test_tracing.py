"""Tracing on the real system: a gateway and two workers export OTLP/HTTP to a real receiver
(tests/otlp_receiver.py, decoding with opentelemetry-proto), and one trace crosses HTTP, Redis
and the workers, a takeover included. Off (no endpoint), nothing of the SDK is even loaded."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import aiohttp
import pytest

from protocol import WORKER_GROUP, Keys, RequestMessage
from protocol.tracing import extract, inject, tracing_enabled
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.service.helpers import MODEL
from tests.services import Worker, running_system, wait_for

# The client's own span, as a caller already inside a trace sends it.
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TAKEOVER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
UNSAMPLED_TRACE = "5af7651916cd43dd8448eb211c80319d"
REFUSED_TRACE = "6af7651916cd43dd8448eb211c80319e"
PROMPT = "zyzzyva quokka marmalade"  # words that must never reach a span
SERVER, PRODUCER, CONSUMER = 2, 4, 5  # opentelemetry.proto's Span.SpanKind values
PHASES = {"jitney.queue_wait", "jitney.admission", "jitney.prefill", "jitney.decode"}
# Every attribute a span may carry: ids, names, counts; nothing that could hold text.
ATTRIBUTES = {
    "http.request.method",
    "http.route",
    "http.response.status_code",
    "gen_ai.request.model",
    "jitney.request.kind",
    "prompts",
    "prompt_tokens",
    "jitney.request.id",
    "messaging.system",
    "messaging.destination.name",
    "jitney.request.priority",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "jitney.usage.cached_tokens",
    "jitney.finish_reason",
    "error.type",
}


def traceparent(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}


def wait_spans(
    receiver: OtlpReceiver, trace_id: str, done: Callable[[list[ReceivedSpan]], bool]
) -> list[ReceivedSpan]:
    def spans() -> list[ReceivedSpan]:
        return [s for s in receiver.received() if s.trace_id == trace_id]

    wait_for(lambda: done(spans()), 30, f"the spans of trace {trace_id}", interval=0.1)
    return spans()


def named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    found = {s.name: s for s in spans if s.parent_span_id == parent.span_id}
    assert len(found) == len([s for s in spans if s.parent_span_id == parent.span_id])
    return found


def worker_done(spans: list[ReceivedSpan], ends: int = 1) -> bool:
    """The gateway's request span and `ends` worker request spans have arrived."""
    roots = named(spans, "jitney.worker.request")
    return bool(named(spans, "POST /v1/completions")) and len(roots) >= ends


def assert_no_text(spans: list[ReceivedSpan], output: str) -> None:
    """Only known attributes; no word of the prompt in any value, nor the output text."""
    for span in spans:
        unknown = set(span.attributes) - ATTRIBUTES
        assert not unknown, f"{span.name} carries {unknown}"
        pairs = [
            *span.attributes.items(),
            *(kv for e in span.events for kv in e.attributes.items()),
        ]
        for key, value in pairs:
            text = str(value)
            assert not any(word in text for word in PROMPT.split()), f"{span.name}.{key}: {text}"
            assert len(output.strip()) < 8 or output not in text, f"{span.name}.{key}: {text}"


def holder(r, workers: list[Worker]) -> Worker:
    """The worker that holds the (one) pending request entry."""
    pending = {
        (c["name"].decode() if isinstance(c["name"], bytes) else c["name"]): c["pending"]
        for c in r.xinfo_consumers(Keys().requests(MODEL), WORKER_GROUP)
    }
    (held,) = [w for w in workers if pending.get(w.worker_id)]
    return held


async def test_one_trace_crosses_the_gateway_redis_and_a_takeover(monkeypatch):
    """The client's traceparent is the parent of the gateway's request span; its parse,
    tokenize and enqueue spans are children; the worker's request span is the enqueue span's
    child, with its queue wait, admission, prefill and decode; a request handed back mid-stream
    is continued by the other worker in the same trace. No span holds prompt or output text,
    and a request whose client said not to sample it leaves no span."""
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: export at once, not in 5 s
        slow = {"JITNEY_FAILPOINTS": "step_delay_ms=20"}  # 150 tokens: about 3 s
        flags = ("--shutdown-timeout", "0")  # SIGTERM hands back at once
        gateway_id = "gw-traced"
        with running_system(
            ("tr1", "tr2"),
            worker_flags=flags,
            worker_env=slow,
            gateway_flags=("--gateway-id", gateway_id),
        ) as system:
            body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
            async with aiohttp.ClientSession() as session:
                await refused_in_parse(system.base, session, receiver)
                unsampled = {"traceparent": f"00-{UNSAMPLED_TRACE}-{CLIENT_SPAN}-00"}
                async with session.post(
                    f"{system.base}/v1/completions",
                    json={**body, "max_tokens": 2},
                    headers=unsampled,
                ) as resp:
                    assert resp.status == 200, await resp.text()
                async with session.post(
                    f"{system.base}/v1/completions",
                    json={**body, "max_tokens": 6},
                    headers=traceparent(CLIENT_TRACE),
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    reply = await resp.json()
                spans = await asyncio.to_thread(wait_spans, receiver, CLIENT_TRACE, worker_done)
                check_request_trace(spans, reply, gateway_id)
                assert_no_text(spans, reply["choices"][0]["text"])

                text = await handed_back_mid_stream(system, session, body)
            spans = await asyncio.to_thread(
                wait_spans, receiver, TAKEOVER_TRACE, lambda s: worker_done(s, ends=2)
            )
            check_takeover_trace(spans)
            assert_no_text(spans, text)
        assert receiver.bad_requests == 0
        # The client said not to sample it (flags 00): neither side recorded it.
        assert not [s for s in receiver.received() if s.trace_id == UNSAMPLED_TRACE]


async def refused_in_parse(base: str, session: aiohttp.ClientSession, receiver) -> None:
    """A 400 whose message quotes the field it refused (here the prompt's words): the parse
    span says the error's type, never its message."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": PROMPT}
    headers = traceparent(REFUSED_TRACE)
    async with session.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 400, await resp.text()

    def done(spans: list[ReceivedSpan]) -> bool:
        return bool(named(spans, "POST /v1/completions"))

    spans = await asyncio.to_thread(wait_spans, receiver, REFUSED_TRACE, done)
    (server,) = named(spans, "POST /v1/completions")
    assert server.attributes["http.response.status_code"] == 400
    (parse,) = named(spans, "jitney.parse")
    assert parse.attributes["error.type"] == "ApiError" and parse.status_code == 2
    assert not parse.events and {s.name for s in spans} == {server.name, parse.name}
    assert_no_text(spans, "")


def check_request_trace(spans: list[ReceivedSpan], reply: dict, gateway_id: str) -> None:
    (server,) = named(spans, "POST /v1/completions")
    assert server.service == "jitney-gateway" and server.kind == SERVER
    assert server.resource["service.instance.id"] == gateway_id
    assert server.parent_span_id == CLIENT_SPAN  # the client's traceparent honoured
    assert server.attributes["http.route"] == "/v1/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.request.model"] == MODEL
    gateway = children(spans, server)
    assert set(gateway) == {"jitney.parse", "jitney.tokenize", "jitney.enqueue"}
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert gateway["jitney.tokenize"].attributes["prompt_tokens"] == prompt_tokens
    enqueue = gateway["jitney.enqueue"]
    assert enqueue.kind == PRODUCER
    assert enqueue.attributes["jitney.request.id"] == reply["id"]
    assert enqueue.attributes["messaging.destination.name"] == Keys().requests(MODEL)

    (root,) = named(spans, "jitney.worker.request")
    assert root.service == "jitney-worker" and root.kind == CONSUMER
    assert root.resource["service.instance.id"] in ("tr1", "tr2")
    assert root.parent_span_id == enqueue.span_id  # across Redis, from the entry's context
    assert root.attributes["jitney.request.id"] == reply["id"]
    assert root.attributes["gen_ai.usage.input_tokens"] == prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == 6
    assert root.attributes["jitney.finish_reason"] == "length"
    phases = children(spans, root)
    assert set(phases) == PHASES
    chunks = [e.attributes["tokens"] for e in phases["jitney.prefill"].events if e.name == "chunk"]
    assert sum(chunks) == prompt_tokens
    (finished,) = [e for e in phases["jitney.decode"].events if e.name == "finished"]
    assert finished.attributes == {"index": 0, "reason": "length", "tokens": 6}
    # In order: enqueued, read, scheduled, first token, done (the worker's clock for the rest).
    order = ["jitney.queue_wait", "jitney.admission", "jitney.prefill", "jitney.decode"]
    for before, after in itertools.pairwise(order):
        assert phases[before].end_ns == phases[after].start_ns
    assert phases["jitney.decode"].end_ns == root.end_ns <= server.end_ns


async def handed_back_mid_stream(system, session: aiohttp.ClientSession, body: dict) -> str:
    """A stream whose worker is told to stop after its first tokens (hands it back at once);
    the other worker finishes it. Returns the streamed text."""
    payload = {**body, "max_tokens": 150, "stream": True}
    headers = traceparent(TAKEOVER_TRACE)
    text, chunks = "", 0
    async with session.post(f"{system.base}/v1/completions", json=payload, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            text += choices[0]["text"] if choices else ""
            chunks += 1
            if chunks == 3:
                victim = holder(system.server.client(), system.workers)
                victim.proc.proc.send_signal(signal.SIGTERM)
    assert victim.proc.proc.wait(30) == 0  # exited, its spans flushed on the way out
    return text


def check_takeover_trace(spans: list[ReceivedSpan]) -> None:
    (enqueue,) = named(spans, "jitney.enqueue")
    roots = named(spans, "jitney.worker.request")
    assert all(r.parent_span_id == enqueue.span_id for r in roots)
    ends = {r.attributes["jitney.finish_reason"]: r for r in roots}
    assert set(ends) == {"handed_back", "length"}
    first, second = ends["handed_back"], ends["length"]
    assert first.resource["service.instance.id"] != second.resource["service.instance.id"]
    assert [e.name for e in first.events] == ["handed_back"]
    assert set(children(spans, first)) == PHASES  # it had started decoding
    (taken,) = [e for e in second.events if e.name == "taken_over"]
    assert taken.attributes["delivered_replies"] > 0 and taken.attributes["deliveries"] >= 1
    assert second.attributes["gen_ai.usage.output_tokens"] == 150
    # A takeover has no queue wait of its own: it starts at the claim.
    assert set(children(spans, second)) == PHASES - {"jitney.queue_wait"}
    assert first.start_ns < first.end_ns <= second.start_ns


def test_off_without_an_endpoint_nothing_is_loaded_or_carried():
    """No OTLP endpoint: no tracer, no middleware, no span around the request path, no context
    in a message; in a fresh process, building the gateway app and the worker's book loads
    neither the SDK's tracing nor an exporter, and starts no thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    assert not tracing_enabled(env)
    assert not tracing_enabled({**env, "OTEL_EXPORTER_OTLP_ENDPOINT": " "})
    endpoint = {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"}
    assert tracing_enabled(endpoint)
    assert not tracing_enabled({**endpoint, "OTEL_SDK_DISABLED": "true"})
    assert not tracing_enabled({**endpoint, "OTEL_TRACES_EXPORTER": "none"})
    script = """
import sys, threading
from gateway.config import GatewayConfig
from gateway.http.app import make_app
from gateway.serving import tracing
from worker.tracing import worker_traces
app = make_app(GatewayConfig())
assert "request_span" not in [m.__name__ for m in app.middlewares]
assert worker_traces("w", "m") is None and tracing.carrier() is None
with tracing.span("jitney.parse") as span:
    assert span is None
# (redis-py imports the SDK's metrics when it is installed: the tracing side must not be.)
tracing_side = ("opentelemetry.sdk.trace", "opentelemetry.exporter")
loaded = sorted(m for m in sys.modules if m.startswith(tracing_side))
assert not loaded, loaded
assert threading.active_count() == 1, threading.enumerate()
"""
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert RequestMessage("r", "m", [1], {}, "x", "g", 0.0).trace_context is None


def test_a_message_carries_only_a_valid_w3c_context():
    """What a worker reads off the wire: a valid traceparent (and tracestate) becomes the
    parent; garbage, a missing or malformed traceparent, or other keys give none."""
    from opentelemetry.trace import get_current_span

    good = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "k=v"}
    context = extract(good)
    assert context is not None
    span = get_current_span(context).get_span_context()
    assert (f"{span.trace_id:032x}", f"{span.span_id:016x}") == (CLIENT_TRACE, CLIENT_SPAN)
    assert inject(context) == good  # round trip
    for bad in (None, "x", ["a"], {}, {"traceparent": 7}, {"traceparent": "00-zz-yy-01"}):
        assert extract(bad) is None  # type: ignore[arg-type]
    assert extract({"baggage": "user=x", "traceparent": None}) is None


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch):
    """The test's own OTEL_* settings only (a developer's shell may export some)."""
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
