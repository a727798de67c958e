"""Gateway metrics on a private registry (several apps in one process, e.g. tests, never clash)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from protocol.metric_buckets import TTFT_BUCKETS


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "jitney_http_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.http_in_flight = Gauge(
            "jitney_http_in_flight", "HTTP requests being handled now", registry=r
        )
        self.queue_lag = Gauge(
            "jitney_queue_lag",
            "Request stream entries not yet delivered to any worker, per model",
            ["model"],
            registry=r,
        )
        self.queue_pending = Gauge(
            "jitney_queue_pending",
            "Request stream entries delivered to a worker, not acked, per model",
            ["model"],
            registry=r,
        )
        self.queued_prompt_tokens = Gauge(
            "jitney_gateway_queued_prompt_tokens",
            "Prompt tokens this gateway enqueued that no worker has started",
            registry=r,
        )
        self.waiting_requests = Gauge(
            "jitney_gateway_waiting_requests",
            "Requests this gateway enqueued that no worker has started, by priority",
            ["priority"],
            registry=r,
        )
        self.key_tokens = Counter(
            "jitney_key_tokens",
            "Tokens of finished requests by API key id ('-': no auth) and model; kind is "
            "prompt or completion",
            ["key_id", "model", "kind"],
            registry=r,
        )
        self.ttft = Histogram(
            "jitney_gateway_time_to_first_token_seconds",
            "Request received to first generated text, as the gateway sees it",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "jitney_gateway_rejected_requests",
            "Requests refused before enqueueing, by reason",
            ["reason"],
            registry=r,
        )
        # Labelled by configured key ids only (unknown keys are 401s, never a label value), so
        # the cardinality is bounded by the keys file.
        self.api_key_requests = Counter(
            "jitney_api_key_requests",
            "HTTP requests answered, by API key id and status",
            ["key_id", "status"],
            registry=r,
        )
        self.auth_failures = Counter(
            "jitney_auth_failures",
            "Requests refused with 401, by reason (missing, invalid)",
            ["reason"],
            registry=r,
        )
        self.placements = Counter(
            "jitney_placements",
            "Requests enqueued, by placement outcome: hit (on the worker holding most of the "
            "prompt), adapter (on a worker holding the request's LoRA adapter), no_hit or busy "
            "(the shared stream)",
            ["model", "outcome"],
            registry=r,
        )
        self.duplicate_replies = Counter(
            "jitney_gateway_duplicate_replies",
            "Reply messages dropped as duplicates (seq already delivered)",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
