"""What one step does: the plain dataclasses a policy hands to the model runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class StepLimit(enum.Enum):
    """Which limit stopped the step from taking more work (users ask what bounds a batch)."""

    NONE = "none"  # nothing left to take
    SEQS = "max_num_seqs"
    TOKENS = "max_num_batched_tokens"
    KV = "kv_blocks"
    BATCH = "batch_running"  # static/dynamic: a batch runs to completion, nothing joins


@dataclass(slots=True)
class ScheduledChunk:
    """Positions [start, start + num_tokens) of one sequence are computed this step. Treat it as
    immutable; not frozen because a frozen dataclass is 4x slower to build (one per running
    sequence per step: ~0.4 ms of a 256-sequence step, measured)."""

    seq_id: str
    start: int
    num_tokens: int
    # The chunk reaches the sequence's last known token, so the step samples its next token.
    samples: bool
    is_prefill: bool
    # A decode that also verifies this many draft tokens: positions [start + 1, start +
    # num_tokens) hold the sequence's `draft_token_ids` (num_tokens = 1 + num_draft_tokens).
    num_draft_tokens: int = 0


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Preempted while planning this step (their KV is freed; recomputed later).
    preempted_seq_ids: list[str] = field(default_factory=list)
    limit: StepLimit = StepLimit.NONE

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def batch_size(self) -> int:
        return len(self.chunks)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def decode_seq_ids(self) -> list[str]:
        return [c.seq_id for c in self.chunks if not c.is_prefill]

    @property
    def prefill_chunks(self) -> dict[str, int]:
        return {c.seq_id: c.num_tokens for c in self.chunks if c.is_prefill}


@dataclass(slots=True)
class SchedulerStats:
    """Filled by the scheduler every step; an exporter elsewhere turns it into metrics."""

    num_running: int = 0
    num_waiting: int = 0
    batch_size: int = 0
    num_batched_tokens: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions_total: int = 0
    num_preempted_tokens_total: int = 0  # computed tokens preemptions threw away (recomputed)
    num_prefix_queries_total: int = 0
    num_prefix_hits_total: int = 0
    # Speculative decoding: draft tokens verified, of which accepted, and the verifications
    # (one per sequence and step that had drafts): acceptance = accepted / drafts.
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0
    num_verifications_total: int = 0
    # Of those, the drafts proposed from earlier replies (scheduler/speculation/history.py).
    num_history_draft_tokens_total: int = 0
    num_history_accepted_tokens_total: int = 0
    # And those from the callers' predictions of their replies (speculation/prediction.py).
    num_prediction_draft_tokens_total: int = 0
    num_prediction_accepted_tokens_total: int = 0
    limit: StepLimit = StepLimit.NONE
