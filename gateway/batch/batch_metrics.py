"""Batch API metrics, on the gateway's private registry (gateway.serving.gateway_metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

# completed: answered 200; failed: answered with an error (in the error file); retried: handed
# back unanswered (queue full, no worker, shutting down); duplicate: answered already elsewhere.
LINE_OUTCOMES = ("completed", "failed", "retried", "duplicate")


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lines = Counter(
            "jitney_batch_lines",
            "Batch lines this gateway ran, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.batches = Counter(
            "jitney_batches_finished",
            "Batches this gateway finalized, by final status",
            ["status"],
            registry=registry,
        )
        for outcome in LINE_OUTCOMES:
            self.lines.labels(outcome)
