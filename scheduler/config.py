"""Scheduler configuration: one frozen dataclass, validated on construction.

Its field defaults are the only copy of the batching defaults: EngineConfig and the engine's CLI
flags read them from `SCHEDULER_DEFAULTS`, so a bare Engine and `jitney worker` cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.speculation.proposer import SpeculativeConfig


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    # Slots: the most sequences in one batch (the batch size of static and dynamic batching).
    max_num_seqs: int = 64
    # Per-step token budget: decode tokens count one each, prefill chunks share what is left.
    max_num_batched_tokens: int = 512
    # Dynamic batching: launch a partial batch once its oldest request has waited this long
    # (same clock as arrival times: seconds in the worker, steps in the simulator, which always
    # passes its own; the default is the worker's, in seconds).
    max_queue_delay: float = 0.05
    # Reserve prompt + max_tokens of KV at admission, so nothing is ever preempted.
    reserve_full_length: bool = False
    # A sequence preempted this many times is no longer chosen as a victim while others exist.
    max_preemptions_per_seq: int = 4
    # Draft tokens verified beside decodes (scheduler/speculation/); method "none": off.
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_queue_delay < 0:
            raise ValueError(f"max_queue_delay must be >= 0, got {self.max_queue_delay}")
        if self.max_preemptions_per_seq < 1:
            raise ValueError(
                f"max_preemptions_per_seq must be >= 1, got {self.max_preemptions_per_seq}"
            )


# The defaults, readable by name (a slotted dataclass has no class-level default attributes).
SCHEDULER_DEFAULTS = SchedulerConfig()
