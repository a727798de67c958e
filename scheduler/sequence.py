"""A request's token sequence and its state machine.

A `Sequence` is one generation request as the scheduler sees it: prompt tokens, the tokens generated
so far, and how many of them are already computed into the KV cache. Every step model in Jitney is
the same catch-up rule: a step computes `num_tokens - num_computed_tokens` tokens (or a chunk of
them). Prefill, chunked prefill, prefix-cache hits and recompute after preemption are all that rule.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.speculation.ngram_index import NgramIndex
    from scheduler.speculation.prediction import Prediction


class SequenceStatus(enum.IntEnum):
    """Lifecycle states. Everything greater than PREEMPTED is terminal."""

    WAITING = 0
    RUNNING = 1
    # Back in the waiting queue (at the front of its priority level) with its KV blocks freed;
    # recomputed on readmission.
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}

_S = SequenceStatus
# The only legal moves. PREEMPTED -> WAITING is not listed: a preempted sequence waits *as*
# PREEMPTED so that stats and logs can tell a recompute from a first admission.
_TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
    _S.RUNNING: frozenset(
        {_S.PREEMPTED, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH, _S.FINISHED_ABORTED}
    ),
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
}


class IllegalTransitionError(RuntimeError):
    """A status change the state machine does not allow: always a scheduler bug."""


@dataclass(slots=True, frozen=True)
class SamplingLimits:
    """The stop conditions the scheduler itself can check. Stop *strings* need text: the
    engine's detokenizer finds them offline, the gateway when served."""

    max_tokens: int
    # User stop ids plus EOS unless the request set ignore_eos: the caller builds the one set.
    stop_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(slots=True)
class SpeculationState:
    """A sequence's speculative decoding (scheduler/speculation/), kept apart from its tokens:
    the policy fills it while it plans and updates steps, the proposers read it."""

    # The engine allows draft tokens for it: nothing but the model's logits and the row's own
    # sampling settings decide each position's token.
    enabled: bool = False
    # Proposed after the last known token for the step being planned; the step keeps the ones
    # the model agrees with (output tokens then) and drops the rest.
    draft_token_ids: list[int] = field(default_factory=list)
    # What proposed them (DraftOdds' kind): their verification's result is measured by it.
    draft_kind: int = 0
    # Its own verifications' counts by (kind, position): its odds lean on them as they grow.
    draft_counts: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    # Prompt lookup's index of its text (speculation/ngram_index.py), built at its first proposal.
    lookup_index: NgramIndex | None = None
    # The reply its caller expects (OpenAI's `prediction`): drafted from first (prediction.py).
    prediction: Prediction | None = None
    # Its speculation so far (on this worker): draft tokens verified, those kept, verifications.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    # Output tokens its latest sampling step gave it: 1 for a decode, the kept drafts and the
    # sampled token for a verification (the live view shows it).
    num_step_tokens: int = 0

    def verified(self, num_drafts: int, num_kept: int) -> None:
        """A verification of `num_drafts` drafts kept `num_kept`: its drafts are spent."""
        self.draft_token_ids = []
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_kept
        self.num_verifications += 1


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    limits: SamplingLimits
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    # vLLM's request priority: lower is served first (admitted first, preempted last).
    priority: int = 0
    # Tokens [0, num_computed_tokens) have their K/V in the cache.
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    # Prompt tokens served from the prefix cache at the latest admission.
    num_cached_tokens: int = 0
    # Set when the sequence is first scheduled / reaches a terminal state (same clock as arrival).
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    # (block size, chained hashes of the full prompt blocks): the block manager's prefix-cache
    # keys, cached here because a waiting prompt is looked up again every step.
    prompt_block_hashes: tuple[int, list[bytes]] | None = None
    # False: never served from the prefix cache (every prompt position is computed, e.g. because
    # the request wants each prompt token's log-prob); its blocks still serve other requests.
    uses_prefix_cache: bool = True
    # Its speculative decoding: whether it may, its drafts in flight, their odds, its totals.
    speculation: SpeculationState = field(default_factory=SpeculationState)
    # The LoRA adapter its rows run under (None: the base model). Part of its prefix-cache
    # hashes: two adapters never share K/V.
    adapter: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"sequence {self.seq_id!r} has an empty prompt")

    @classmethod
    def create(
        cls,
        seq_id: str,
        prompt_token_ids: SequenceABC[int],
        max_tokens: int,
        arrival_time: float = 0.0,
        stop_token_ids: SequenceABC[int] = (),
        output_token_ids: SequenceABC[int] = (),
        priority: int = 0,
        adapter: str | None = None,
    ) -> Sequence:
        """`output_token_ids`: tokens already generated elsewhere (a request taken over from a
        dead worker); like a preempted sequence, its K/V is recomputed before it samples again.
        `adapter`: the LoRA adapter it runs under (None: the base model)."""
        limits = SamplingLimits(max_tokens, frozenset(stop_token_ids))
        if len(output_token_ids) >= max_tokens:
            n = len(output_token_ids)
            raise ValueError(f"{seq_id!r}: {n} output tokens already, max_tokens {max_tokens}")
        output = list(output_token_ids)
        seq = cls(seq_id, list(prompt_token_ids), limits, arrival_time, output, priority)
        seq.adapter = adapter
        return seq

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """The most tokens whose K/V this sequence can ever need (the last sample is never fed)."""
        return self.num_prompt_tokens + self.limits.max_tokens - 1

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    def set_status(self, new: SequenceStatus) -> None:
        """The one place a status changes."""
        if new not in _TRANSITIONS.get(self.status, frozenset()):
            raise IllegalTransitionError(f"{self.seq_id}: {self.status.name} -> {new.name}")
        self.status = new

    def append_token(self, token_id: int) -> SequenceStatus | None:
        """Record a sampled token; return the terminal status it causes, if any."""
        self.output_token_ids.append(token_id)
        if token_id in self.limits.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.limits.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None
