"""Where an engine step's time goes: propose (a draft model's passes, speculative decoding),
schedule, prepare inputs, forward, sample, postprocess.

Always on: one `time.perf_counter()` per phase boundary, so the phases are consecutive laps and
cover the step with no gap. The worker exports them (`jitney_step_phase_seconds`) and
`jitney bench offline` tabulates them.

On CUDA the forward's kernels run asynchronously: the engine synchronizes the device at the end
of the forward lap (`Engine._run`), a wait the sampler's `.tolist()` would pay a moment later
anyway, so the forward lap holds the device's compute time and `sample` only the sampler's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch


@dataclass(slots=True)
class StepTiming:
    """Seconds one step spent in each phase; an empty step (nothing scheduled) has only
    schedule and postprocess (and propose, with a draft model)."""

    propose: float = 0.0  # a draft model's passes (--speculative-model); 0 without one
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    postprocess: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.as_dict().values())

    @property
    def overhead(self) -> float:
        """Everything but the model's forward pass: what a zero-overhead engine would not pay."""
        return self.total - self.forward

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PHASES}

    def add(self, other: StepTiming) -> None:
        """Accumulate `other` (a bench sums its steps)."""
        for name in PHASES:
            setattr(self, name, getattr(self, name) + getattr(other, name))


# The engine's phases in step order; the worker adds PUBLISH (its Redis round trip) after them.
PHASES = tuple(f.name for f in fields(StepTiming))
PUBLISH = "publish"


class PhaseClock:
    """Laps of one step: `lap(phase)` charges the time since the previous lap to `phase`."""

    def __init__(self) -> None:
        self.timing = StepTiming()
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        setattr(self.timing, phase, getattr(self.timing, phase) + now - self._last)
        self._last = now


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); a no-op where calls are synchronous (CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
