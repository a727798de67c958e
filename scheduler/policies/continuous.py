"""Continuous (iteration-level) batching, as in Orca and vLLM: every step is a new decision.

Priority is vLLM's: an integer per request, lower is more urgent. With one priority everywhere
this is plain FIFO continuous batching.

One step:
1. Running sequences, oldest first, each get their next tokens (a decode: 1; a prefill in
   progress: the next chunk) within the token budget. If one cannot get a KV block, the least
   urgent running sequence (newest among equals) is preempted (recompute) until it can, or
   until it was the victim itself (then only more urgent sequences after it still grow).
2. Only if nobody was preempted: waiting sequences are admitted in queue order (by priority,
   FIFO within one) while a slot, token budget and KV blocks allow. A head that finds the slots
   full or the blocks short preempts running sequences strictly less urgent than itself (least
   urgent first) until it fits; never for one of equal or lower urgency, and never in
   reservation mode (which promises no preemption); a victim is not readmitted in the step that
   evicted it. A long prompt takes `min(budget left, prompt left)` tokens and finishes its
   prefill in later steps, sharing them with decodes (chunked prefill).
With speculation on (scheduler/speculation/), a decoding sequence that the engine lets
speculate gets a verification instead of a plain decode (its last token and the proposer's
drafts in one chunk) while the step's rows stay within `max_step_tokens`, the budget and
free blocks allow (never by preempting), and the drafts' measured odds pay for their rows
(scheduler/speculation/odds.py).
Finished sequences leave the batch in the update of the step that finished them.
"""

from __future__ import annotations

import logging

from scheduler.block_manager import KVBlockManager
from scheduler.config import SchedulerConfig
from scheduler.plan import StepLimit, StepPlan
from scheduler.policies.base import BatchingPolicy
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.speculation import Proposal, Speculator

logger = logging.getLogger("jitney.scheduler")


class ContinuousBatching(BatchingPolicy):
    name = "continuous"
    runs_to_completion = False  # admits and preempts at every step

    def __init__(
        self, config: SchedulerConfig, kv: KVBlockManager, speculator: Speculator | None = None
    ):
        super().__init__(config, kv, speculator)
        # The least urgent priority ever queued: a waiting head at least this high has nobody
        # to preempt, which spares a full batch with one priority a scan of `running` per step.
        self._least_urgent = float("-inf")

    def add_request(self, seq: Sequence, front: bool = False) -> None:
        super().add_request(seq, front)
        self._least_urgent = max(self._least_urgent, seq.priority)

    def _plan_step(self, plan: StepPlan, now: float) -> None:
        budget = self._grow_running(plan, self.config.max_num_batched_tokens)
        if plan.preempted_seq_ids:
            plan.limit = StepLimit.KV
            return  # do not admit new work in a step that had to evict running work
        self._admit_waiting(plan, budget)

    def _grow_running(self, plan: StepPlan, budget: int) -> int:
        """Schedule every running sequence's next tokens, preempting under KV pressure.
        Returns the token budget left."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                if budget == 0:
                    plan.limit = StepLimit.TOKENS
                    break
                i += 1
                continue
            if (
                num_new == 1
                and self.speculator.proposer is not None  # (checked first: a decode's hot path)
                and (drafts := self._drafts(seq, budget, plan, i))
            ):
                self._add_verification(plan, seq, drafts)
                budget -= 1 + len(drafts)
                i += 1
                continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1  # an earlier victim (less urgent, or capped over) shifts `seq` left
                budget += self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                self._add_chunk(plan, seq, num_new)
                budget -= num_new
                i += 1
                continue
            # `seq` itself was the victim; only more urgent sequences after it may still grow
            # (with one priority, nobody after it is left but capped ones: stop, as always).
            if not any(s.priority < seq.priority for s in self.running[i:]):
                plan.limit = StepLimit.KV
                break
        return budget

    def _drafts(self, seq: Sequence, budget: int, plan: StepPlan, i: int) -> Proposal | None:
        """Draft tokens for a decoding sequence to verify this step, their KV allocated: those of
        its proposal whose measured odds pay for their rows; None when it does not speculate.
        Speculation never preempts: without spare free blocks for the drafts the sequence
        decodes plainly."""
        spec = self.speculator.config
        if not spec.batch_speculates(len(self.running)):
            return None
        # The step's rows so far, this token and one for each running sequence after it.
        rows = plan.num_batched_tokens + len(self.running) - i
        # The drafts and the token sampled after them must fit the budget too.
        room = min(spec.num_drafts(seq, rows), budget - 1)
        if room < 1:
            return None
        drafts = self.speculator.drafts(seq, room, len(self.running))
        if not drafts:
            return None
        # Leave a free block for every running sequence, so that the drafts never make another
        # sequence's plain decode preempt.
        kv = self.kv
        grow = kv.blocks_for(seq.num_tokens + len(drafts)) - len(kv.block_ids(seq.seq_id))
        if grow > 0 and kv.num_free_blocks - grow < len(self.running):
            return None
        return drafts if kv.allocate_slots(seq, 1 + len(drafts)) else None

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        if not self.waiting and len(self.running) >= self.config.max_num_seqs:
            # Full with nothing waiting here: a worker leaves the rest in the queue (it reads only
            # what it can admit), so the slots are still what bounds the step.
            plan.limit = StepLimit.SEQS
            return
        while self.waiting:
            head = self.waiting.peek()
            if head.seq_id in plan.preempted_seq_ids:
                plan.limit = StepLimit.KV  # evicted for a more urgent one: readmitting it thrashes
                return
            full = len(self.running) >= self.config.max_num_seqs
            if not full:
                if budget == 0:
                    plan.limit = StepLimit.TOKENS
                    return
                # Strict queue order: a head that does not fit blocks those behind it (no
                # starvation within a priority).
                num_new = self._try_admit_head(budget, plan)
                if num_new is not None:
                    budget -= num_new
                    continue
            # No slot, or no KV for the head: only a less urgent running sequence can make room.
            refund = self._preempt_for(head, plan)
            if refund is None:
                plan.limit = StepLimit.SEQS if full else StepLimit.KV
                return
            budget += refund

    def _preempt_for(self, head: Sequence, plan: StepPlan) -> int | None:
        """Preempt one running sequence strictly less urgent than `head` to make room for it.
        Returns the tokens the victim gives back to the step's budget; None if there is none
        (or in reservation mode, which promises never to preempt)."""
        if (
            self.config.reserve_full_length
            or head.priority >= self._least_urgent
            or not self.running
        ):
            return None
        victim = self._pick_victim()
        return self._preempt(victim, plan) if victim.priority > head.priority else None

    def _pick_victim(self) -> Sequence:
        """The least urgent running sequence (the highest priority value), the newest among
        equals, skipping those already preempted too often while their level has others."""
        least = max(seq.priority for seq in self.running)
        cap = self.config.max_preemptions_per_seq
        level = [seq for seq in reversed(self.running) if seq.priority == least]
        return next((seq for seq in level if seq.num_preemptions < cap), level[0])

    def _preempt(self, seq: Sequence, plan: StepPlan) -> int:
        """Evict `seq` (recompute later); returns the tokens it had scheduled in `plan`."""
        self.running.remove(seq)
        refund = sum(c.num_tokens for c in plan.chunks if c.seq_id == seq.seq_id)
        plan.chunks = [c for c in plan.chunks if c.seq_id != seq.seq_id]
        self.kv.free(seq)
        seq.speculation.draft_token_ids = []
        seq.set_status(SequenceStatus.PREEMPTED)
        lost, seq.num_computed_tokens = seq.num_computed_tokens, 0
        seq.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self.stats.num_preempted_tokens_total += lost
        # Which request paid, and how much: users cannot otherwise tell why one request was slow.
        logger.info(
            "preempted request=%s priority=%d lost_tokens=%d times=%d",
            seq.seq_id,
            seq.priority,
            lost,
            seq.num_preemptions,
        )
        self.waiting.appendleft(seq)
        plan.preempted_seq_ids.append(seq.seq_id)
        return refund
