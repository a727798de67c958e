"""Test factories (style: vLLM's make_scheduler/make_requests) and a fake model step."""

from __future__ import annotations

import zlib

from scheduler import BatchingPolicy, Sequence, StepPlan


def make_seq(
    seq_id: str,
    prompt_len: int = 8,
    max_tokens: int = 4,
    arrival: float = 0.0,
    base: int = 0,
    stop_token_ids: tuple[int, ...] = (),
) -> Sequence:
    """A sequence with a distinct prompt (token ids start at `base`, default from its id)."""
    base = base or (zlib.crc32(seq_id.encode()) % 10_000) * 1000 + 1
    return Sequence.create(
        seq_id, [base + i for i in range(prompt_len)], max_tokens, arrival, stop_token_ids
    )


def run_step(
    policy: BatchingPolicy, now: float = 0.0, token: int = 7, stopped: tuple[str, ...] = ()
) -> tuple[StepPlan, list[Sequence]]:
    """One fake model step: sample `token` for every chunk that samples."""
    plan = policy.schedule(now)
    sampled = {c.seq_id: token for c in plan.chunks if c.samples}
    released = policy.update(plan, sampled, stopped, now + 1)
    policy.kv.check_integrity()
    return plan, released
