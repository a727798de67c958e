"""LoRA adapters, seen from a worker: requests started under each adapter, and which adapters
the batch runs and waits on now.

`jitney_lora_requests_info` is vLLM's `vllm:lora_requests_info` (worker/vllm_metrics.py aliases
it): its labels name the adapters of the running and of the waiting requests (comma-joined) and
`max_lora`, its value is the unix time they were read, as vLLM sets it. vLLM keeps a series for
every combination it ever saw; here the previous one is removed when the adapters change, so the
exporter holds one series, the current one.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from engine.engine_view import EngineView
from scheduler import SequenceStatus

# Reading the adapters walks every running and waiting sequence: a few times a second is enough
# for a gauge scraped every few seconds, and never shows in a step.
READ_INTERVAL_S = 0.5
_WAITING = (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)


class LoraMetrics:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self._labels = labels
        self._requests = Counter(
            "jitney_lora_requests",
            "Requests started under each LoRA adapter (a takeover is counted where it started)",
            (*labels, "adapter"),
            registry=registry,
        )
        self._info = Gauge(
            "jitney_lora_requests_info",
            "The LoRA adapters of the running and of the waiting requests (labels, comma-joined) "
            "and max_lora; the value: the unix time they were read",
            (*labels, "running_lora_adapters", "waiting_lora_adapters", "max_lora"),
            registry=registry,
        )
        self._max_lora: str | None = None  # None: the worker serves no adapter
        self._current: tuple[str, str] | None = None
        self._next_at = 0.0

    def enable(self, max_loras: int) -> None:
        """The worker serves adapters: export the info gauge (`max_loras`: its label)."""
        self._max_lora = str(max_loras)

    def started(self, adapter: str) -> None:
        self._requests.labels(**self._labels, adapter=adapter).inc()

    def observe(self, view: EngineView) -> None:
        """Once per loop iteration; reads the engine at most every READ_INTERVAL_S."""
        now = time.monotonic()
        if self._max_lora is None or now < self._next_at:
            return
        self._next_at = now + READ_INTERVAL_S
        running: set[str] = set()
        waiting: set[str] = set()
        for seq in view.sequences():
            if seq.adapter is not None:
                (waiting if seq.status in _WAITING else running).add(seq.adapter)
        current = (",".join(sorted(running)), ",".join(sorted(waiting)))
        if self._current is not None and self._current != current:
            self._info.remove(*self._label_values(self._current))
        self._current = current
        self._info.labels(*self._label_values(current)).set(time.time())

    def _label_values(self, adapters: tuple[str, str]) -> tuple[str, ...]:
        assert self._max_lora is not None
        return (*self._labels.values(), *adapters, self._max_lora)
