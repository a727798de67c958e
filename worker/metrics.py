"""The worker's Prometheus exporter: turns SchedulerStats and served requests into metrics.

The scheduler only fills `SchedulerStats` (it never imports prometheus); the service loop hands
those stats, step timings and per-request events to this exporter. Names follow
docs/architecture.md §6: prefix `jitney_`, seconds, `_total` counters, labels `model` and `worker`.
Buckets follow vLLM's, so the same dashboards read alike.

Every exporter has its own CollectorRegistry, so several in one process (tests) never collide.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

from engine.step_timing import PHASES, PUBLISH, StepTiming
from protocol.metric_buckets import TTFT_BUCKETS
from scheduler import SchedulerStats
from worker.lora_metrics import LoraMetrics
from worker.metrics_server import bind_metrics_port
from worker.placement_metrics import PlacementMetrics
from worker.vllm_metrics import served_registry

ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A phase of a step: from a 0.1 ms schedule on an idle CPU to a multi-second prefill forward.
STEP_PHASE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ACCEPTANCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
ACCEPTED_LENGTH_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 16.0)

LABELS = ("model", "worker")
HANDOFF_EVENTS = ("taken_over", "handed_back", "dead_lettered", "gateway_gone", "history_lost")


class WorkerMetrics:
    def __init__(self, model: str, worker_id: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._labels = {"model": model, "worker": worker_id}
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=r, buckets=buckets).labels(**self._labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(**self._labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(**self._labels)

        self.batch_size = hist("jitney_batch_size", "Sequences per step", BATCH_SIZE_BUCKETS)
        self.batch_size_current = gauge("jitney_batch_size_current", "Sequences in the last step")
        self.batch_tokens = hist("jitney_batch_tokens", "Tokens per step", BATCH_TOKENS_BUCKETS)
        self.queue_delay = hist(
            "jitney_queue_delay_seconds",
            "Gateway enqueue to first scheduled",
            REQUEST_LATENCY_BUCKETS,
        )
        self.running = gauge("jitney_requests_running", "Requests holding a batch slot")
        self.waiting = gauge("jitney_requests_waiting", "Requests read but not yet admitted")
        self.kv_usage = gauge("jitney_kv_cache_usage_ratio", "Used KV blocks / total (0..1)")
        self.kv_free = gauge("jitney_kv_blocks_free", "Free KV blocks (cached ones included)")
        self.kv_total = gauge("jitney_kv_blocks_total", "KV blocks in the pool")
        self._engine_info = Gauge(
            "jitney_engine_info",
            "1, labelled with how the worker's engine runs: its forward (weights), the KV "
            "cache's dtype and block size",
            (*LABELS, "forward", "kv_cache_dtype", "block_size"),
            registry=r,
        )
        self.preemptions = counter("jitney_preemptions", "Sequences preempted (recompute)")
        self.preempted_tokens = counter(
            "jitney_preempted_tokens", "Computed tokens preemptions threw away (recomputed later)"
        )
        self.ttft = hist(
            "jitney_time_to_first_token_seconds", "Gateway enqueue to first token", TTFT_BUCKETS
        )
        self.itl = hist(
            "jitney_inter_token_latency_seconds", "Time between a request's tokens", ITL_BUCKETS
        )
        self.e2e = hist(
            "jitney_e2e_request_latency_seconds",
            "Gateway enqueue to final reply",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = counter("jitney_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("jitney_generation_tokens", "Tokens generated")
        self._finished = Counter(
            "jitney_requests_finished",
            "Requests by terminal outcome",
            (*LABELS, "reason"),
            registry=r,
        )
        self.step_duration = hist(
            "jitney_step_duration_seconds", "One engine step (schedule+run+sample)", STEP_BUCKETS
        )
        self._step_phases = Histogram(
            "jitney_step_phase_seconds",
            "Time per step in each phase: propose (a draft model's passes), schedule, prepare, "
            "forward, sample, postprocess, publish (the replies' Redis round trip)",
            (*LABELS, "phase"),
            registry=r,
            buckets=STEP_PHASE_BUCKETS,
        )
        self._phase = {
            phase: self._step_phases.labels(**self._labels, phase=phase)
            for phase in (*PHASES, PUBLISH)
        }
        self.prefix_hits = counter("jitney_prefix_cache_hits", "Prompt tokens served from cache")
        self.prefix_queries = counter(
            "jitney_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        # Speculative decoding (--speculative): acceptance = accepted / draft tokens.
        self.spec_drafts = counter(
            "jitney_spec_decode_num_drafts", "Verifications: one sequence's drafts in one step"
        )
        self.spec_draft_tokens = counter(
            "jitney_spec_decode_num_draft_tokens", "Draft tokens verified"
        )
        self.spec_accepted_tokens = counter(
            "jitney_spec_decode_num_accepted_tokens", "Draft tokens the model accepted"
        )
        self.spec_history_draft_tokens = counter(
            "jitney_spec_decode_history_draft_tokens",
            "Draft tokens verified that were proposed from earlier replies "
            "(--speculative-history-tokens)",
        )
        self.spec_history_accepted_tokens = counter(
            "jitney_spec_decode_history_accepted_tokens",
            "Draft tokens from earlier replies the model accepted",
        )
        self.spec_prediction_draft_tokens = counter(
            "jitney_spec_decode_prediction_draft_tokens",
            "Draft tokens verified that came from the requests' predictions of their replies "
            "(OpenAI's `prediction`)",
        )
        self.spec_prediction_accepted_tokens = counter(
            "jitney_spec_decode_prediction_accepted_tokens",
            "Draft tokens from the requests' predictions the model accepted",
        )
        self.spec_row_cost = gauge(
            "jitney_spec_decode_draft_row_cost",
            "What a draft row costs as a share of a one-row step, as the policy prices it now "
            "(measured from the engine's decode steps unless configured)",
        )
        # Per finished choice that verified drafts: how its speculation went.
        self.spec_request_acceptance = hist(
            "jitney_spec_decode_request_acceptance_ratio",
            "Per finished request (choice) that speculated: accepted / draft tokens",
            ACCEPTANCE_BUCKETS,
        )
        self.spec_request_accepted_length = hist(
            "jitney_spec_decode_request_mean_accepted_length",
            "Per finished request (choice) that speculated: draft tokens kept per verification",
            ACCEPTED_LENGTH_BUCKETS,
        )
        self._handoffs = Counter(
            "jitney_request_handoffs",
            "Requests taken over from a dead worker, handed back, dead-lettered, or aborted "
            "because their gateway died",
            (*LABELS, "event"),
            registry=r,
        )
        for event in HANDOFF_EVENTS:  # exported as 0 from the start: rate() and alerts see them
            self._handoffs.labels(**self._labels, event=event)
        self._steps = Counter(
            "jitney_steps",
            "Engine steps by the limit that bound them",
            (*LABELS, "limit"),
            registry=r,
        )
        self.placement = PlacementMetrics(r, self._labels)
        self.lora = LoraMetrics(r, self._labels)
        # The scheduler's counters are running totals; the exporter adds their increments.
        self._last_totals: tuple[int, ...] = ()  # none yet: all zero
        # /ready answers this (the service sets it: joined and not stopping).
        self.ready: Callable[[], bool] = lambda: False  # until the service says it joined

    def handoff(self, event: str, n: int = 1) -> None:
        """event: one of HANDOFF_EVENTS."""
        if n:
            self._handoffs.labels(**self._labels, event=event).inc(n)

    def serve(
        self, port: int | ThreadingWSGIServer, addr: str = "0.0.0.0", vllm_names: bool = False
    ) -> int:
        """Serve /metrics, /health (the process is up) and /ready (taking work) in a background
        thread, on `port` or on a server bound earlier (worker/metrics_server.py); returns the
        port (useful when `port` is 0). `vllm_names`: also export the metrics under vLLM's names
        (worker/vllm_metrics.py)."""
        disable_created_metrics()  # no `_created` series: dashboards never read them
        metrics_app = make_wsgi_app(served_registry(self.registry) if vllm_names else self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/health":
                start_response("200 OK", [("Content-Type", "text/plain")])
                return [b"ok\n"]
            if path == "/ready":
                ok = self.ready()
                start_response(
                    "200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")]
                )
                return [b"ready\n" if ok else b"not ready\n"]
            return metrics_app(environ, start_response)

        server = bind_metrics_port(port, addr) if isinstance(port, int) else port
        server.set_app(app)
        threading.Thread(target=server.serve_forever, name="jitney-metrics", daemon=True).start()
        return server.server_port

    # ----- per step ------------------------------------------------------------------------
    def observe_step(self, stats: SchedulerStats, duration_s: float) -> None:
        self.step_duration.observe(duration_s)
        self._steps.labels(**self._labels, limit=stats.limit.value).inc()
        if stats.batch_size:
            self.batch_size.observe(stats.batch_size)
            self.batch_tokens.observe(stats.num_batched_tokens)
        self.batch_size_current.set(stats.batch_size)
        totals = (
            stats.num_preemptions_total,
            stats.num_preempted_tokens_total,
            stats.num_prefix_hits_total,
            stats.num_prefix_queries_total,
            stats.num_verifications_total,
            stats.num_draft_tokens_total,
            stats.num_accepted_tokens_total,
            stats.num_history_draft_tokens_total,
            stats.num_history_accepted_tokens_total,
            stats.num_prediction_draft_tokens_total,
            stats.num_prediction_accepted_tokens_total,
        )
        counters = (
            self.preemptions,
            self.preempted_tokens,
            self.prefix_hits,
            self.prefix_queries,
            self.spec_drafts,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
            self.spec_history_draft_tokens,
            self.spec_history_accepted_tokens,
            self.spec_prediction_draft_tokens,
            self.spec_prediction_accepted_tokens,
        )
        last = self._last_totals or (0,) * len(totals)
        for child, new, old in zip(counters, totals, last, strict=True):
            if new > old:
                child.inc(new - old)
        self._last_totals = totals

    def observe_row_cost(self, cost: float) -> None:
        self.spec_row_cost.set(cost)

    def observe_phases(self, timing: StepTiming) -> None:
        for phase, seconds in timing.as_dict().items():
            self._phase[phase].observe(seconds)

    def observe_publish(self, seconds: float) -> None:
        self._phase[PUBLISH].observe(seconds)

    def describe_engine(self, forward: str, kv_cache_dtype: str, block_size: int) -> None:
        """Set once at start: what a dashboard shows beside the pool's gauges."""
        self._engine_info.labels(
            **self._labels,
            forward=forward,
            kv_cache_dtype=kv_cache_dtype,
            block_size=str(block_size),
        ).set(1)

    def set_state(
        self, running: int, waiting: int, kv_usage: float, free_blocks: int, total_blocks: int
    ) -> None:
        """Live gauges, set after every loop iteration (so an abort shows at once)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.kv_free.set(free_blocks)
        self.kv_total.set(total_blocks)
        if running == 0:
            self.batch_size_current.set(0)

    # ----- per request ---------------------------------------------------------------------
    def speculated(self, draft_tokens: int, accepted_tokens: int, verifications: int) -> None:
        """A finished choice's speculation, when it verified any drafts."""
        if verifications:
            self.spec_request_acceptance.observe(accepted_tokens / draft_tokens)
            self.spec_request_accepted_length.observe(accepted_tokens / verifications)

    def finished(self, reason: str, prompt_tokens: int, e2e_s: float | None) -> None:
        self._finished.labels(**self._labels, reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if e2e_s is not None:
            self.e2e.observe(max(0.0, e2e_s))
