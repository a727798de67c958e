"""Speculative decoding, the engine's side: which choices may speculate, and the verification.

A verifying sequence's chunk is its last token and its k drafts (scheduler/speculation/). The
forward returns logits for all k + 1 positions: the chunk's first k as extra rows after the
sampling rows (the same mechanism as prompt log-probs), the last as its sampling row. Each
position is sampled as plain decoding samples it (greedy: the argmax; sampled: the seeded draw of
that output position), draft j + 1 is kept while it equals the pick at position j, and the first
pick that differs (or the pick after the last draft) is the step's sampled token.

For a sampled row this is rejection sampling: a prompt-lookup draft is one token, not a
distribution, so keeping it with probability p(draft) and otherwise drawing from p without it
is the same as drawing from p and keeping the draft when the draw is it. Every token is the
model's own draw, and a seeded request's tokens are those of plain sampling, position for
position (up to the rounding of a different kernel: the parity tests' near-tie rule).

Rows whose logits depend on the tokens before them within the chunk (penalties, bias,
min_tokens, grammars) or that want log-probs do not speculate: the scheduler gives them no drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.sampler import sample
from generation.sampling_params import SamplingParams
from scheduler import StepPlan

if TYPE_CHECKING:  # engine.choices builds choices with may_speculate
    from engine.choices import ChoiceState


def may_speculate(params: SamplingParams, has_grammar: bool) -> bool:
    """Whether a choice's rows can be verified by comparing picks (see the module docstring)."""
    return not params.adjusts_logits and params.logprobs is None and not has_grammar


def draft_rows(plan: StepPlan) -> dict[str, int]:
    """Sequence id -> its chunk's leading positions whose logits the step must also return."""
    return {c.seq_id: c.num_draft_tokens for c in plan.chunks if c.num_draft_tokens}


def verify_drafts(
    logits: torch.Tensor,  # [sum of k, vocab]: the draft rows, in chunk order
    rows: dict[str, int],
    reqs: dict[str, ChoiceState],
    sampled: dict[str, int],
) -> dict[str, list[int]]:
    """The drafts each verifying sequence keeps; `sampled` gets the pick after the last of
    them. One pick over every draft row of the step (position j: output index n + j)."""
    params = [reqs[seq_id].params for seq_id, k in rows.items() for _ in range(k)]
    positions = [
        reqs[seq_id].seq.num_output_tokens + j for seq_id, k in rows.items() for j in range(k)
    ]
    picks = sample(logits, params, positions)
    accepted: dict[str, list[int]] = {}
    at = 0
    for seq_id, k in rows.items():
        drafts = reqs[seq_id].seq.draft_token_ids
        mine = picks[at : at + k]
        at += k
        n = 0
        while n < k and drafts[n] == mine[n]:
            n += 1
        accepted[seq_id] = mine[:n]
        if n < k:  # the model's own token where the first wrong draft stood
            sampled[seq_id] = mine[n]
    return accepted
