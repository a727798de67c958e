"""What every batching policy shares: the queues, the KV gate calls, stepping and release.

A policy only decides *who* runs in a step (`schedule`); the bookkeeping after a step ran
(`update`), aborts and stats are the same for all three and live here.

Step contract (the engine and the simulator drive every policy alike):
    plan = policy.schedule(now)              # chunks to compute; KV already allocated
    sampled = run(plan)                      # one token for every chunk with `samples`
    released = policy.update(plan, sampled, stopped_seq_ids, now_after_step, accepted)

`stopped_seq_ids`: sequences whose text reached a stop string, as the engine's detokenizer
found it (served, the gateway finds stop strings and has the request aborted). A chunk with
draft tokens (speculative decoding, continuous batching only) gives its sequence the drafts the
model accepted (`accepted`, in order) and then its sampled token. Who proposes drafts, and what
they are measured against, is the policy's `Speculator` (scheduler/speculation/speculator.py),
given when it is built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping

from scheduler.block_manager import KVBlockManager
from scheduler.config import SchedulerConfig
from scheduler.plan import ScheduledChunk, SchedulerStats, StepPlan
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.speculation import Proposal, Speculator, speculator_for
from scheduler.waiting_queue import WaitingQueue


class InfeasibleRequestError(ValueError):
    """The request cannot fit the KV pool even when it runs alone."""


class BatchingPolicy(ABC):
    name: str = "base"

    def __init__(
        self, config: SchedulerConfig, kv: KVBlockManager, speculator: Speculator | None = None
    ):
        """`speculator`: its speculative decoding, built for `config.speculative`
        (`speculator_for`); None: the one those settings give without an engine."""
        self.config = config
        self.kv = kv
        # Waiting (and preempted, at the front of their priority) in admission order: by
        # priority (lower first), FIFO within one.
        self.waiting = WaitingQueue()
        # Admission order: running[-1] is the most recently admitted.
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self.stats = SchedulerStats(num_total_blocks=kv.num_blocks)
        if speculator is None:
            speculator = speculator_for(config.speculative)
        elif speculator.config != config.speculative:
            raise ValueError("the speculator was built for other speculative settings")
        self.speculator = speculator

    # ----- requests in and out -----------------------------------------------------------------
    def add_request(self, seq: Sequence, front: bool = False) -> None:
        """Queue `seq` FIFO within its priority, or at the front of it (the further choices of a
        request whose prompt has just been computed: admitted next, they find its blocks in the
        prefix cache)."""
        if seq.seq_id in self.seqs:
            raise ValueError(f"duplicate sequence id {seq.seq_id!r}")
        if self._blocks_needed_alone(seq) > self.kv.num_blocks:
            raise InfeasibleRequestError(
                f"request {seq.seq_id!r} needs {seq.max_total_tokens} tokens of KV cache "
                f"({seq.num_prompt_tokens} prompt + {seq.limits.max_tokens} max_tokens - 1) = "
                f"{self._blocks_needed_alone(seq)} blocks of {self.kv.block_size}, but the "
                f"whole pool has {self.kv.num_blocks} blocks"
            )
        self.seqs[seq.seq_id] = seq
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def abort(self, seq_id: str, now: float = 0.0) -> Sequence | None:
        """Stop a request wherever it is; its blocks are free when this returns."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.status.is_finished:
            return None
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, SequenceStatus.FINISHED_ABORTED, now)
        self._release(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def flush(self) -> None:  # noqa: B027 - an optional hook, deliberately empty here
        """No more requests will arrive (offline runs). Only a policy that waits for a full
        batch has anything to do with this."""

    # Static/dynamic batching: a batch runs to completion before the next is admitted, and
    # every request reserves prompt + max_tokens at admission. Continuous batching says False.
    runs_to_completion: bool = True

    def preemptible_priority(self) -> int | None:
        """The priority a more urgent new request would preempt for: the least urgent holding
        a slot. None when the policy never preempts for a newcomer (a batch runs to
        completion), when nothing runs, or when a waiting request is already more urgent than
        it (the next steps preempt for that one first). A pass over the running sequences."""
        holders = self.slot_holders()
        if not holders or self.runs_to_completion:
            return None
        least_urgent = max(seq.priority for seq in holders)
        if self.waiting and self.waiting.peek().priority < least_urgent:
            return None
        return least_urgent

    def slot_holders(self) -> list[Sequence]:
        """Sequences occupying a batch slot right now."""
        return list(self.running)

    # ----- one step ----------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        self._plan_step(plan, now)
        for chunk in plan.chunks:
            seq = self.seqs[chunk.seq_id]
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        self._fill_stats(plan)
        return plan

    @abstractmethod
    def _plan_step(self, plan: StepPlan, now: float) -> None:
        """Append chunks to `plan` (allocating their KV) and set `plan.limit`."""

    def update(
        self,
        plan: StepPlan,
        sampled_token_ids: Mapping[str, int],
        stopped_seq_ids: Collection[str] = (),
        now: float = 0.0,
        accepted: Mapping[str, list[int]] | None = None,
    ) -> list[Sequence]:
        """Apply a step's results. `stopped_seq_ids` are sequences whose text reached a stop
        string; `accepted`, the draft tokens each verifying sequence keeps (before its sampled
        token). Returns the sequences released to their clients in this update."""
        done: list[Sequence] = []
        for chunk in plan.chunks:
            seq = self.seqs.get(chunk.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            if chunk.num_draft_tokens:
                kept = (accepted or {}).get(seq.seq_id, [])
                finish = self._verified(seq, chunk, [*kept, sampled_token_ids[seq.seq_id]])
            else:
                seq.num_computed_tokens = chunk.start + chunk.num_tokens
                self.kv.commit_computed(seq)
                if not chunk.samples:
                    continue
                finish = seq.append_token(sampled_token_ids[seq.seq_id])
                seq.speculation.num_step_tokens = 1
            if finish is None and seq.seq_id in stopped_seq_ids:
                finish = SequenceStatus.FINISHED_STOPPED
            if finish is not None:
                self._finish(seq, finish, now)
                done.append(seq)
        return self._on_finished(done, now)

    def _verified(
        self, seq: Sequence, chunk: ScheduledChunk, tokens: list[int]
    ) -> SequenceStatus | None:
        """A verification's result: `tokens`, the accepted drafts then the sampled token. The
        fed token and the accepted drafts hold K/V now; the rejected drafts' slots go back to
        the pool. Returns the terminal status a kept token causes (the rest are not kept)."""
        num_accepted = len(tokens) - 1
        seq.num_computed_tokens = chunk.start + 1 + num_accepted
        self.kv.trim(seq, seq.num_computed_tokens, self._reserve_tokens(seq))
        self.speculator.record(seq.speculation, chunk.num_draft_tokens, num_accepted, self.stats)
        for n, token in enumerate(tokens, 1):
            seq.speculation.num_step_tokens = n
            if (finish := seq.append_token(token)) is not None:
                return finish
        return None

    def _on_finished(self, done: list[Sequence], now: float) -> list[Sequence]:
        """Continuous batching releases finished sequences at once (policies may hold them)."""
        for seq in done:
            self.running.remove(seq)
            self._release(seq)
        return done

    # ----- shared mechanics --------------------------------------------------------------------
    def _finish(self, seq: Sequence, status: SequenceStatus, now: float) -> None:
        seq.set_status(status)
        seq.finished_time = now
        self.speculator.finished(seq.output_token_ids)

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq)
        del self.seqs[seq.seq_id]

    def _blocks_needed_alone(self, seq: Sequence) -> int:
        return self.kv.blocks_for(seq.max_total_tokens)

    def _reserve_tokens(self, seq: Sequence) -> int:
        return seq.max_total_tokens if self.config.reserve_full_length else 0

    def _try_admit_head(self, token_budget: int, plan: StepPlan) -> int | None:
        """Move the head of waiting into running with its first chunk, if the KV allows.
        Returns the tokens scheduled for it (0 when the budget is spent), None if it did not fit."""
        seq = self.waiting.peek()
        num_new = min(seq.num_tokens - self.kv.num_cached_tokens(seq), token_budget)
        if not self.kv.allocate_slots(seq, num_new, self._reserve_tokens(seq)):
            return None
        self.waiting.popleft()
        seq.set_status(SequenceStatus.RUNNING)
        self.running.append(seq)
        self._add_chunk(plan, seq, num_new)
        return num_new

    def _add_verification(self, plan: StepPlan, seq: Sequence, drafts: Proposal) -> None:
        """A decode that also computes `drafts` after the sequence's last token (KV allocated)."""
        seq.speculation.draft_token_ids, seq.speculation.draft_kind = drafts.tokens, drafts.kind
        start, num_tokens = seq.num_computed_tokens, 1 + len(drafts)
        plan.chunks.append(ScheduledChunk(seq.seq_id, start, num_tokens, True, False, len(drafts)))

    def _add_chunk(self, plan: StepPlan, seq: Sequence, num_new: int) -> None:
        if num_new <= 0:
            return
        start, num_tokens = seq.num_computed_tokens, seq.num_tokens
        # A decode feeds back the one token sampled last step; anything else is (re)prefill.
        is_decode = num_new == 1 and seq.num_output_tokens > 0 and start == num_tokens - 1
        samples = start + num_new == num_tokens
        plan.chunks.append(ScheduledChunk(seq.seq_id, start, num_new, samples, not is_decode))

    def _fill_stats(self, plan: StepPlan) -> None:
        s = self.stats
        s.num_running = len(self.running)
        s.num_waiting = len(self.waiting)
        s.batch_size = plan.batch_size
        s.num_batched_tokens = plan.num_batched_tokens
        s.kv_usage = self.kv.usage
        s.num_free_blocks = self.kv.num_free_blocks
        s.num_prefix_queries_total = self.kv.num_prefix_queries
        s.num_prefix_hits_total = self.kv.num_prefix_hits
        s.limit = plan.limit
