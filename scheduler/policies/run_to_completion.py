"""Static and dynamic batching: a batch launches, then runs until its last sequence finishes.

Nothing joins a running batch, and a sequence that finishes early keeps its slot (and its KV
blocks, like the padding of a static batch) until the whole batch is done: that is when its
result is returned. The two policies differ only in when a batch launches:
- static: once a full batch waits: `max_num_seqs` requests, or as many as the KV pool holds
  (or when `flush()` said no more will come);
- dynamic (Triton's dynamic batcher): also when the oldest waiting request has waited
  `max_queue_delay`.
A batch reserves prompt + max_tokens of KV per member at launch, so it can never be preempted;
when the pool cannot hold a full batch, the batch is the prefix of the waiting queue that fits
(most urgent priority first, FIFO within one).
"""

from __future__ import annotations

from scheduler.block_manager import KVBlockManager
from scheduler.config import SchedulerConfig
from scheduler.plan import StepLimit, StepPlan
from scheduler.policies.base import BatchingPolicy
from scheduler.sequence import Sequence
from scheduler.speculation import Speculator


class StaticBatching(BatchingPolicy):
    name = "static"

    def __init__(
        self, config: SchedulerConfig, kv: KVBlockManager, speculator: Speculator | None = None
    ):
        super().__init__(config, kv, speculator)
        self._done_in_batch: list[Sequence] = []
        self._flushing = False

    def flush(self) -> None:
        """No more requests will arrive: launch a partial batch instead of waiting forever."""
        self._flushing = True

    def _should_launch(self, now: float) -> bool:
        return self._flushing or self._full_batch_waiting()

    def _full_batch_waiting(self) -> bool:
        """Enough requests wait to fill every slot, or to fill the KV pool (then more
        requests could not join the batch anyway)."""
        free = self.kv.num_free_blocks
        for n, seq in enumerate(self.waiting):
            if n == self.config.max_num_seqs:
                return True
            free -= self.kv.blocks_for(seq.max_total_tokens)
            if free <= 0:
                return True
        return len(self.waiting) >= self.config.max_num_seqs

    def _reserve_tokens(self, seq: Sequence) -> int:
        return seq.max_total_tokens

    def _plan_step(self, plan: StepPlan, now: float) -> None:
        budget = self.config.max_num_batched_tokens
        if not self.running and not self._done_in_batch and self.waiting:
            if not self._should_launch(now):
                return
            self._launch(plan, budget)
        else:
            for seq in self.running:
                num_new = min(seq.num_uncomputed_tokens, budget)
                # Reserved at launch, so this cannot fail.
                if num_new and self.kv.allocate_slots(seq, num_new):
                    self._add_chunk(plan, seq, num_new)
                    budget -= num_new
        plan.limit = StepLimit.BATCH if self.waiting else StepLimit.NONE
        if budget == 0:
            plan.limit = StepLimit.TOKENS

    def _launch(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            num_new = self._try_admit_head(budget, plan)
            if num_new is None:
                break  # the pool is full of this batch's reservations
            budget -= num_new

    def _on_finished(self, done: list[Sequence], now: float) -> list[Sequence]:
        # Also reached with `done` empty after an abort emptied the batch: the held members go.
        for seq in done:
            self.running.remove(seq)
        self._done_in_batch.extend(done)
        if self.running:
            return []
        released, self._done_in_batch = self._done_in_batch, []
        for seq in released:
            seq.finished_time = now  # the client gets it with the rest of the batch
            self._release(seq)
        return released

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self._done_in_batch)

    def slot_holders(self) -> list[Sequence]:
        return self.running + self._done_in_batch


class DynamicBatching(StaticBatching):
    name = "dynamic"

    def _should_launch(self, now: float) -> bool:
        waited = now - self.waiting.oldest_arrival()
        return super()._should_launch(now) or waited >= self.config.max_queue_delay
