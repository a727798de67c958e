"""vLLM's metric names for the worker's metrics, opt-in (`jitney worker --vllm-metrics`), so
dashboards and autoscaling rules written for vLLM work unchanged.

Nothing is counted twice: at scrape time each mapped family of the worker's registry is copied
under vLLM's name (v1 names), with the label `model` renamed `model_name`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# Family names as prometheus_client keeps them (counters without `_total`).
VLLM_NAMES = {
    "jitney_requests_running": "vllm:num_requests_running",
    "jitney_requests_waiting": "vllm:num_requests_waiting",
    "jitney_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",  # a fraction in vLLM v1 too
    "jitney_preemptions": "vllm:num_preemptions",
    "jitney_prompt_tokens": "vllm:prompt_tokens",
    "jitney_generation_tokens": "vllm:generation_tokens",
    "jitney_requests_finished": "vllm:request_success",
    "jitney_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "jitney_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "jitney_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "jitney_queue_delay_seconds": "vllm:request_queue_time_seconds",
    "jitney_prefix_cache_hits": "vllm:prefix_cache_hits",
    "jitney_prefix_cache_queries": "vllm:prefix_cache_queries",
    "jitney_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "jitney_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "jitney_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "jitney_lora_requests_info": "vllm:lora_requests_info",
}
LABEL_NAMES = {"model": "model_name", "reason": "finished_reason"}


class WithVllmNames(Collector):
    """Everything in `registry`, plus the mapped families again under vLLM's names."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            yield family
            alias = VLLM_NAMES.get(family.name)
            if alias is None:
                continue
            copy = Metric(alias, family.documentation, family.type, family.unit)
            copy.samples = [
                s._replace(
                    name=alias + s.name[len(family.name) :],
                    labels={LABEL_NAMES.get(k, k): v for k, v in s.labels.items()},
                )
                for s in family.samples
            ]
            yield copy


def served_registry(registry: CollectorRegistry) -> CollectorRegistry:
    served = CollectorRegistry(auto_describe=False)
    served.register(WithVllmNames(registry))
    return served
