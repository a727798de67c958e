"""The worker's spans of a request's life, on a real engine driven as the loop drives it
(research/tracing_cost.py's `admit` and `step`): chunked prefills, preemptions under a KV pool too
small for the batch, finishes. The SDK's in-memory exporter keeps what a real exporter would
send."""

from __future__ import annotations

import itertools
import random

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.models.model_loader import LoadedModel, load_model
from generation.sampling_params import SamplingParams
from research.tracing_cost import PARENT, Round, admit, step
from worker.metrics import WorkerMetrics
from worker.request_book import RequestBook
from worker.tracing import WorkerTraces

PHASES = ["jitney.queue_wait", "jitney.admission", "jitney.prefill", "jitney.decode"]
TRACE_ID, PARENT_SPAN_ID = (int(part, 16) for part in PARENT["traceparent"].split("-")[1:3])


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-random")


def run(engine: Engine, requests: list[tuple[list[int], int]]) -> list[ReadableSpan]:
    """Every request admitted at once, stepped to the end; the spans they made."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traces = WorkerTraces(provider.get_tracer("test"), engine.config.model)
    book = RequestBook(WorkerMetrics(engine.config.model, "w"), traces=traces)
    for i, (prompt, n) in enumerate(requests):
        admit(engine, book, f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    steps = Round()
    while book.tracked:
        step(engine, book, steps)
        assert steps.steps < 2000
    assert not (traces.live or traces.pending or traces.preempted)  # nothing held after the end
    return list(exporter.get_finished_spans())


def by_request(spans: list[ReadableSpan]) -> dict[str, dict[str, ReadableSpan]]:
    """Each request's spans by name (its root's children found through their parent id)."""
    roots = {s.context.span_id: s for s in spans if s.name == "jitney.worker.request"}
    out = {root.attributes["jitney.request.id"]: {root.name: root} for root in roots.values()}
    for s in spans:
        if s.parent is not None and s.parent.span_id in roots:
            request = roots[s.parent.span_id].attributes["jitney.request.id"]
            assert s.name not in out[request], f"two {s.name} spans for {request}"
            out[request][s.name] = s
    return out


def events(span: ReadableSpan, name: str) -> list[dict]:
    return [dict(e.attributes) for e in span.events if e.name == name]


def test_spans_follow_a_request_through_chunks_and_finish(loaded):
    """Prompts longer than the step's token budget: each prefill span's chunk events add up to
    the prompt, the phases tile the request's life in order, the attributes count tokens."""
    rng = random.Random(1)
    requests = [([rng.randrange(3, 250) for _ in range(rng.randrange(9, 30))], 5) for _ in range(4)]
    engine = Engine(
        EngineConfig(model=loaded.name, max_num_seqs=4, max_num_batched_tokens=8), loaded=loaded
    )
    spans = run(engine, requests)
    assert len(spans) == 5 * len(requests) and all(s.context.trace_id == TRACE_ID for s in spans)
    traced = by_request(spans)
    for i, (prompt, n) in enumerate(requests):
        tree = traced[f"r{i}"]
        root = tree["jitney.worker.request"]
        assert sorted(tree) == sorted([root.name, *PHASES])
        assert root.kind == SpanKind.CONSUMER and root.parent.span_id == PARENT_SPAN_ID
        assert root.attributes["gen_ai.usage.input_tokens"] == len(prompt)
        assert root.attributes["gen_ai.usage.output_tokens"] == n
        assert root.attributes["jitney.finish_reason"] == "length"
        chunks = [e["tokens"] for e in events(tree["jitney.prefill"], "chunk")]
        assert sum(chunks) == len(prompt) and max(chunks) <= 8 and len(chunks) >= 2
        assert events(tree["jitney.decode"], "finished") == [
            {"index": 0, "reason": "length", "tokens": n}
        ]
        phases = [tree[name] for name in PHASES]
        assert root.start_time == phases[0].start_time and phases[-1].end_time == root.end_time
        for before, after in itertools.pairwise(phases):
            assert before.start_time <= before.end_time == after.start_time
    engine.block_manager.check_integrity()


def test_preemptions_are_events_and_each_resumes(loaded):
    """A KV pool too small for the batch: every preemption the scheduler counted is a
    `preempted` event on its request's prefill or decode span, followed by a `resumed` one."""
    rng = random.Random(4)
    requests = [
        ([rng.randrange(3, 250) for _ in range(rng.randrange(8, 20))], 24) for _ in range(6)
    ]
    # tiny-random: 512 B of K/V per token; 2 KiB per block of 4 -> 14 blocks = 56 tokens.
    config = EngineConfig(
        model=loaded.name, block_size=4, kv_cache_memory=str(14 * 2048), max_num_seqs=6
    )
    engine = Engine(config, loaded=loaded)
    traced = by_request(run(engine, requests))
    preempted = resumed = 0
    for i, (prompt, _) in enumerate(requests):
        tree = traced[f"r{i}"]
        prefill = tree["jitney.prefill"]
        chunks = sum(e["tokens"] for e in events(prefill, "chunk"))
        # A prefill preempted part-way computes its prompt again: its chunks count both.
        assert chunks == len(prompt) if not events(prefill, "preempted") else chunks >= len(prompt)
        for name in ("jitney.prefill", "jitney.decode"):
            marks = [e.name for e in tree[name].events if e.name in ("preempted", "resumed")]
            assert marks == ["preempted", "resumed"] * (len(marks) // 2), marks
            preempted += marks.count("preempted")
            resumed += marks.count("resumed")
        assert tree["jitney.worker.request"].attributes["gen_ai.usage.output_tokens"] == 24
    assert preempted == resumed == engine.stats.num_preemptions_total > 0
