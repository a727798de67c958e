"""Continuous (iteration-level) batching, as in Orca and vLLM: every step is a new decision.

One step:
1. Running sequences, oldest first, each get their next tokens (a decode: 1; a prefill in
   progress: the next chunk) within the token budget. If one cannot get a KV block, the newest
   running sequence is preempted (recompute) until it can, or until it was the victim itself.
2. Only if nobody was preempted: waiting sequences are admitted in FIFO order while a slot, token
   budget and KV blocks allow. A long prompt takes `min(budget left, prompt left)` tokens and
   finishes its prefill in later steps, sharing them with decodes (chunked prefill).
Finished sequences leave the batch in the update of the step that finished them.
"""

from __future__ import annotations

import logging

from scheduler.plan import StepLimit, StepPlan
from scheduler.policies.base import BatchingPolicy
from scheduler.sequence import Sequence, SequenceStatus

logger = logging.getLogger("jitney.scheduler")


class ContinuousBatching(BatchingPolicy):
    name = "continuous"

    def _plan_step(self, plan: StepPlan, now: float) -> None:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # seq_id -> tokens, to refund a victim scheduled earlier
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
            while not self.kv.allocate_slots(seq, num_new):
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1  # an earlier (capped-over) victim shifts `seq` left
                budget += scheduled.pop(victim.seq_id, 0)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                self._add_chunk(plan, seq, num_new)
                scheduled[seq.seq_id] = num_new
                budget -= num_new
                i += 1
                continue
            # `seq` itself was preempted: nobody after it is left in running.
            plan.limit = StepLimit.KV
            break

        if plan.preempted_seq_ids:
            plan.limit = StepLimit.KV
            return  # do not admit new work in a step that had to evict running work
        self._admit_waiting(plan, budget)

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        if not self.waiting and len(self.running) >= self.config.max_num_seqs:
            # Full with nothing waiting here: a worker leaves the rest in the queue (it reads only
            # what it can admit), so the slots are still what bounds the step.
            plan.limit = StepLimit.SEQS
            return
        while self.waiting:
            if len(self.running) >= self.config.max_num_seqs:
                plan.limit = StepLimit.SEQS
                return
            if budget == 0:
                plan.limit = StepLimit.TOKENS
                return
            # Strict FIFO: a head that does not fit blocks those behind it (no starvation).
            num_new = self._try_admit_head(budget, plan)
            if num_new is None:
                plan.limit = StepLimit.KV
                return
            budget -= num_new

    def _pick_victim(self) -> Sequence:
        """The newest running sequence, skipping those already preempted too often."""
        cap = self.config.max_preemptions_per_seq
        for seq in reversed(self.running):
            if seq.num_preemptions < cap:
                return seq
        return self.running[-1]

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        plan.chunks = [c for c in plan.chunks if c.seq_id != seq.seq_id]
        self.kv.free(seq)
        seq.set_status(SequenceStatus.PREEMPTED)
        lost, seq.num_computed_tokens = seq.num_computed_tokens, 0
        seq.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self.stats.num_preempted_tokens_total += lost
        # Which request paid, and how much: users cannot otherwise tell why one request was slow.
        logger.info(
            "preempted request=%s lost_tokens=%d times=%d", seq.seq_id, lost, seq.num_preemptions
        )
        self.waiting.appendleft(seq)
        plan.preempted_seq_ids.append(seq.seq_id)
