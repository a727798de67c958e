"""The engine as code outside it may read it: seats, KV blocks, admission, sequences, graphs.

The worker (admission and metrics), the live view's snapshot and the benchmarks read only this;
the scheduler's policy and block manager, the engine's choices and its runner stay inside.
`EngineView` computes each value when read (the worker reads some every loop iteration, so
nothing is copied that it does not ask for); `sequences()` copies out what the live view shows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler import Sequence, SequenceStatus
from scheduler.prefix_cache_log import CacheChanges

if TYPE_CHECKING:
    from engine.llm_engine import Engine


@dataclass(frozen=True, slots=True)
class SequenceView:
    """One choice holding a batch seat or waiting for one."""

    request_id: str
    index: int  # the choice
    status: SequenceStatus
    num_output_tokens: int
    max_tokens: int
    num_computed_tokens: int  # tokens whose K/V are in the cache
    num_tokens: int  # prompt + output
    priority: int
    num_step_tokens: int = 0  # output tokens its latest sampling step gave (speculation: > 1)
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)

    @property
    def num_uncomputed_tokens(self) -> int:
        """More than one (the token sampled last) while it prefills: chunked, or a recompute."""
        return self.num_tokens - self.num_computed_tokens


@dataclass(frozen=True, slots=True)
class DecodeGraphsView:
    """The decode steps run on the padded (CUDA-graph) path."""

    num_captured: int  # graphs captured so far
    num_steps: int  # decode steps run on this path (replayed, or padded eagerly)
    failed: str | None  # why capture was given up (every step eager since)


class EngineView:
    __slots__ = ("_engine",)

    def __init__(self, engine: Engine):
        self._engine = engine

    @property
    def forward_name(self) -> str:
        """Which forward runs the model ("jitney-gguf", "transformers", ...)."""
        return self._engine.startup.forward_name

    # ----- seats ---------------------------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        return self._engine.config.max_num_seqs

    @property
    def num_running(self) -> int:
        """Requests holding a batch slot now."""
        return len(self._engine.policy.slot_holders())

    @property
    def num_waiting(self) -> int:
        """Added but not admitted (or preempted back to waiting)."""
        return len(self._engine.policy.waiting)

    @property
    def runs_to_completion(self) -> bool:
        """Static or dynamic batching: a batch runs to completion before the next is admitted
        (and every request reserves prompt + max_tokens at admission)."""
        return self._engine.policy.runs_to_completion

    @property
    def reserves_full_length(self) -> bool:
        """Whether admission reserves KV blocks for prompt + max_tokens of a request."""
        return self._engine.config.reserve_full_length or self.runs_to_completion

    @property
    def num_admittable_seats(self) -> int:
        """Seats a new request could take now: while a batch runs to completion, those left to
        assemble the next one (none while it runs); otherwise the free slots, none while
        something read is still waiting. (KV blocks may bound it further: `kv_free_blocks`.)"""
        running, waiting, seats = self.num_running, self.num_waiting, self.max_num_seqs
        if self.runs_to_completion:
            return 0 if running else max(0, seats - waiting)
        return 0 if waiting else max(0, seats - running)

    def preemptible_priority(self) -> int | None:
        """The priority a more urgent new request would preempt for (the policy's answer:
        scheduler/policies/base.py)."""
        return self._engine.policy.preemptible_priority()

    @property
    def draft_row_cost(self) -> float:
        """What a draft row costs as a share of a one-row step: measured from the engine's
        decode steps unless configured (scheduler/speculation/row_cost.py)."""
        return self._engine.policy.speculator.row_cost.cost

    # ----- KV blocks -----------------------------------------------------------------------
    @property
    def kv_total_blocks(self) -> int:
        return self._engine.block_manager.num_blocks

    @property
    def kv_cache_dtype(self) -> str:
        """What the pool stores ("float16", ...: `--kv-cache-dtype` resolved)."""
        return str(self._engine.kv_cache.spec.dtype).removeprefix("torch.")

    @property
    def kv_free_blocks(self) -> int:
        return self._engine.block_manager.num_free_blocks

    @property
    def resident_adapters(self) -> list[str]:
        """The LoRA adapters in memory now (placement prefers a worker holding a request's)."""
        return self._engine.adapters.resident_names

    @property
    def kv_used_blocks(self) -> int:
        return self._engine.block_manager.num_used_blocks

    @property
    def kv_usage(self) -> float:
        return self._engine.block_manager.usage

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that `num_tokens` tokens take."""
        return self._engine.block_manager.blocks_for(num_tokens)

    # ----- the prefix cache (the worker's summary of it: worker/prefix_summary.py) ----------
    @property
    def block_size(self) -> int:
        return self._engine.block_manager.block_size

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache holds now."""
        return self._engine.block_manager.cached_hashes()

    def drain_prefix_cache_changes(self) -> CacheChanges:
        """What entered and left the prefix cache since the last call. The one call here that
        changes anything: the position of the cache's change log, whose one reader it is."""
        return self._engine.block_manager.drain_cache_changes()

    # ----- requests ------------------------------------------------------------------------
    def first_scheduled_time(self, request_id: str) -> float | None:
        """When the request was first scheduled (time.monotonic()), None if not yet or unknown."""
        req = self._engine.choices.by_seq.get(request_id)
        return None if req is None else req.seq.first_scheduled_time

    def prompt_token_ids(self) -> list[list[int]]:
        """The prompt of every live choice (fault injection looks for a token in them)."""
        return [req.seq.prompt_token_ids for req in self._engine.choices.by_seq.values()]

    def sequences(self, max_waiting: int | None = None) -> list[SequenceView]:
        """The sequences holding a seat (as `num_running` counts them), then the first
        `max_waiting` waiting ones (all when None) in admission order."""
        policy = self._engine.policy
        queued: Iterable[Sequence] = itertools.islice(policy.waiting, max_waiting)
        return [self._sequence(seq) for seq in itertools.chain(policy.slot_holders(), queued)]

    def _sequence(self, seq: Sequence) -> SequenceView:
        req = self._engine.choices.by_seq.get(seq.seq_id)
        request_id, index = (req.request_id, req.index) if req is not None else (seq.seq_id, 0)
        return SequenceView(
            request_id,
            index,
            seq.status,
            seq.num_output_tokens,
            seq.limits.max_tokens,
            seq.num_computed_tokens,
            seq.num_tokens,
            seq.priority,
            seq.speculation.num_step_tokens,
            seq.adapter,
        )

    # ----- the device ----------------------------------------------------------------------
    @property
    def decode_graphs(self) -> DecodeGraphsView | None:
        """The CUDA-graph path's counts; None when decode graphs are off."""
        graphs = self._engine.runner.graphs
        if graphs is None:
            return None
        return DecodeGraphsView(len(graphs.graphs), graphs.num_steps, graphs.failed)
