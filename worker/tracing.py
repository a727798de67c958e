"""A request's life in the worker as OpenTelemetry spans, continuing the gateway's trace.

Off (no OTLP endpoint set), `worker_traces` returns None: the book holds no `WorkerTraces`, a
tracked request no `RequestTrace`, and the loop pays one None check per step. On, the loop
records timestamps and counts as the request goes (cheap: no span object until it ends), and
its spans are made at once when it ends, with their real start and end times, under the
context its queue entry carried (the gateway's enqueue span):

    jitney.worker.request (CONSUMER)   the entry's enqueue (a takeover: its claim) to the end
    ├── jitney.queue_wait              enqueue (the gateway's clock) to this worker's read
    ├── jitney.admission               read to first scheduled (the engine's waiting queue)
    ├── jitney.prefill                 first scheduled to first token; a `chunk` event a step
    └── jitney.decode                  first token to the end; `preempted`/`resumed` events,
                                       a `finished` event per choice

A takeover continues the same trace: its request span has a `taken_over` event (replies
already delivered, deliveries) and no queue wait; the worker that handed a request back ends
its spans with a `handed_back` event. A worker killed outright loses the spans it had not ended
(as its batch processor's queue). Per step, the work is bounded by the requests not decoding
yet: steady decoding costs one comparison. Attributes are ids, counts and names, never text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.engine_view import EngineView, SequenceView
from engine.outputs import RequestOutput
from protocol import RequestMessage
from protocol.tracing import WORKER_SERVICE, extract, is_sampled, make_tracer
from scheduler import SequenceStatus
from scheduler.plan import SchedulerStats

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

Event = tuple[str, float, dict[str, Any]]  # name, monotonic time, attributes
HANDED_BACK = "handed_back"  # the end of a request this worker gave back (or was fenced from)


def worker_traces(worker_id: str, model: str) -> WorkerTraces | None:
    """The worker's tracing, or None when it is off (no OTLP endpoint in the environment)."""
    tracer = make_tracer(WORKER_SERVICE, instance_id=worker_id)
    return None if tracer is None else WorkerTraces(tracer, model)


@dataclass(slots=True)
class RequestTrace:
    """What a request's spans will say, gathered while it runs (monotonic seconds)."""

    parent: Context | None  # the gateway's enqueue span, from the entry
    attributes: dict[str, Any]
    enqueue_time: float
    read_time: float
    taken_over: bool = False
    scheduled: float | None = None  # first scheduled
    first_token: float | None = None
    computed: int = 0  # choice 0's computed tokens when last looked at (its prefill chunks)
    chunks: list[Event] = field(default_factory=list)
    prefill_events: list[Event] = field(default_factory=list)
    decode_events: list[Event] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # the request span's own

    def mark_taken_over(self, num_replies: int, deliveries: int) -> None:
        """Claimed from a worker that died or handed it back: the same trace goes on here."""
        self.taken_over = True
        event = {"delivered_replies": num_replies, "deliveries": deliveries}
        self.events.append(("taken_over", self.read_time, event))

    def phase_events(self) -> list[Event]:
        """Where an event of now belongs: prefill until the first token, then decode."""
        return self.prefill_events if self.first_token is None else self.decode_events


class WorkerTraces:
    """The worker's traced requests: their timestamps while they run, their spans at the end."""

    def __init__(self, tracer: Tracer, model: str):
        self.tracer = tracer
        self.model = model
        self.live: dict[str, RequestTrace] = {}  # started in the engine, not ended
        self.pending: set[str] = set()  # live, no token yet
        self.preempted: set[tuple[str, int]] = set()  # (request, choice) back in waiting
        self.num_preemptions = 0  # the scheduler's count when last looked at
        # unix = monotonic + offset: span times are unix nanoseconds, the loop's monotonic.
        self.offset = time.time() - time.monotonic()

    # ----- a request's life ------------------------------------------------------------------
    def open(
        self, msg: RequestMessage, stream: str, read_time: float, enqueue_time: float
    ) -> RequestTrace | None:
        """A request read from `stream` (or claimed); its spans' parent comes off the entry.
        None when that parent is not sampled (the sampler would record nothing of it)."""
        parent = extract(msg.trace_context)
        if parent is not None and not is_sampled(parent):
            return None
        prompt = msg.prompt_token_ids
        attributes = {
            "jitney.request.id": msg.request_id,
            "gen_ai.request.model": self.model,
            "jitney.request.priority": msg.priority,
            "gen_ai.usage.input_tokens": len(prompt) if isinstance(prompt, list) else 0,
            "messaging.destination.name": stream,
        }
        return RequestTrace(parent, attributes, enqueue_time, read_time)

    def started(self, request_id: str, trace: RequestTrace) -> None:
        """The engine took the request: from now on each step may move it on."""
        self.live[request_id] = trace
        self.pending.add(request_id)

    def on_step(
        self,
        view: EngineView,
        stats: SchedulerStats,
        outputs: list[RequestOutput],
        start: float,
        now: float,
    ) -> None:
        """After a step (from `start` to `now`): first schedules, prefill chunks, first tokens,
        preemptions and resumptions. Nothing to look at while every request decodes."""
        preempting = stats.num_preemptions_total != self.num_preemptions or self.preempted
        if not (self.pending or preempting):
            return
        self.num_preemptions = stats.num_preemptions_total
        # The running sequences (and, around preemptions, the waiting ones) once for the step.
        seqs = view.sequences(None if preempting else 0)
        if self.pending:
            self._prefill(view, seqs, outputs, start, now)
        if preempting:
            self._preemptions(seqs, now)

    def end(
        self,
        request_id: str,
        trace: RequestTrace,
        now: float,
        reason: str,
        **attributes: Any,
    ) -> None:
        """The request ended here (finished, rejected, handed back): its spans go out."""
        self.live.pop(request_id, None)
        self.pending.discard(request_id)
        if self.preempted:
            self.preempted = {key for key in self.preempted if key[0] != request_id}
        trace.attributes.update(attributes)
        trace.attributes["jitney.finish_reason"] = reason
        if reason == HANDED_BACK:
            trace.events.append((reason, now, {}))
        self._emit(trace, now, reason)

    # ----- per step ---------------------------------------------------------------------------
    def _prefill(
        self,
        view: EngineView,
        seqs: list[SequenceView],
        outputs: list[RequestOutput],
        start: float,
        now: float,
    ) -> None:
        live, pending = self.live, self.pending
        for request_id in pending:
            trace = live[request_id]
            if trace.scheduled is None:
                trace.scheduled = view.first_scheduled_time(request_id)
        for seq in seqs:  # a chunk: what choice 0 computed this step
            if seq.index == 0 and seq.request_id in pending:
                trace = live[seq.request_id]
                if seq.num_computed_tokens > trace.computed:
                    tokens = seq.num_computed_tokens - trace.computed
                    trace.chunks.append(("chunk", now, {"tokens": tokens}))
                    trace.computed = seq.num_computed_tokens
        for out in outputs:
            if out.new_token_ids and out.request_id in pending:
                trace = live[out.request_id]
                # One that finished within its first step was scheduled at the step's start.
                trace.scheduled = start if trace.scheduled is None else trace.scheduled
                trace.first_token = now
                pending.discard(out.request_id)
                if out.finished and not trace.chunks:  # ended in its first step: one chunk
                    trace.chunks.append(("chunk", now, {"tokens": out.num_prompt_tokens}))

    def _preemptions(self, seqs: list[SequenceView], now: float) -> None:
        for seq in seqs:
            trace = self.live.get(seq.request_id)
            if trace is None:
                continue
            key = (seq.request_id, seq.index)
            if seq.status == SequenceStatus.PREEMPTED and key not in self.preempted:
                self.preempted.add(key)
                event = {"index": seq.index, "output_tokens": seq.num_output_tokens}
                trace.phase_events().append(("preempted", now, event))
                if seq.index == 0:  # its KV is gone: a prefill's chunks start over
                    trace.computed = 0
            elif seq.status == SequenceStatus.RUNNING and key in self.preempted:
                self.preempted.discard(key)
                trace.phase_events().append(("resumed", now, {"index": seq.index}))

    # ----- the spans ------------------------------------------------------------------------
    def _emit(self, trace: RequestTrace, end: float, reason: str) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        start = trace.read_time if trace.taken_over else min(trace.enqueue_time, trace.read_time)
        root = self.tracer.start_span(
            "jitney.worker.request",
            context=trace.parent,
            kind=SpanKind.CONSUMER,
            attributes=trace.attributes,
            start_time=self._ns(start),
        )
        context = set_span_in_context(root)
        scheduled, first = trace.scheduled, trace.first_token
        if not trace.taken_over:
            self._child(context, "jitney.queue_wait", trace.enqueue_time, trace.read_time)
        self._child(context, "jitney.admission", trace.read_time, scheduled or end)
        if scheduled is not None:
            prefill = trace.chunks + trace.prefill_events
            self._child(context, "jitney.prefill", scheduled, first or end, prefill)
        if first is not None:
            self._child(context, "jitney.decode", first, end, trace.decode_events)
        self._add_events(root, trace.events)
        if reason == "error":
            root.set_status(Status(StatusCode.ERROR))
        root.end(end_time=self._ns(end))

    def _child(
        self, context: Context, name: str, start: float, end: float, events: Sequence[Event] = ()
    ) -> None:
        span = self.tracer.start_span(name, context=context, start_time=self._ns(start))
        self._add_events(span, events)
        span.end(end_time=self._ns(max(start, end)))

    def _add_events(self, span: Span, events: Sequence[Event]) -> None:
        for name, at, attributes in events:
            span.add_event(name, attributes, timestamp=self._ns(at))

    def _ns(self, monotonic: float) -> int:
        return int((monotonic + self.offset) * 1e9)
