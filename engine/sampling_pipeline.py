"""After the forward: the step's logits become one token per sampling row, and what rows asked.

In step order, for the rows of the choices that sample (in chunk order):
1. before the forward: which prompt positions must return logits too (prompt log-probs);
2. while the forward runs: the grammar masks of the constrained rows (engine/grammar_masks.py);
3. after it: the prompt rows' log-probs collected, then penalties, bias and min_tokens
   (`adjust_logits`), the grammar masks, the pick (`sample`), each token's log-probs when asked,
   and every grammar advanced by its token (a completed or refused one ends its request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.choices import ChoiceState, ChoiceTable
from engine.grammar_masks import Grammars, apply_masks
from engine.sampler import TokenHistory, TokenLogprobs, adjust_logits, sample, token_logprobs
from scheduler import StepPlan


@dataclass(slots=True)
class StepResult:
    """What one forward pass and its sampling produced."""

    sampled: dict[str, int] = field(default_factory=dict)  # the token of every sequence sampled
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # of those that asked
    grammar_done: set[str] = field(default_factory=set)  # grammar complete with this token


@dataclass(slots=True)
class SamplingRows:
    """The step's sampling rows: the logits' first len(seq_ids) rows, in chunk order."""

    seq_ids: list[str]
    reqs: list[ChoiceState]
    # Sequence id -> prompt positions (from its chunk's start) whose logits follow the rows.
    prompt_rows: dict[str, int]
    constrained: list[int]  # the rows with a grammar


def sampling_rows(plan: StepPlan, choices: ChoiceTable) -> SamplingRows:
    """The rows a step's logits will hold, and which of them need more than a pick."""
    seq_ids = [c.seq_id for c in plan.chunks if c.samples]
    reqs = [choices.by_seq[i] for i in seq_ids]
    constrained = []
    if choices.constrained:
        constrained = [j for j, r in enumerate(reqs) if r.matcher is not None]
    return SamplingRows(seq_ids, reqs, _prompt_rows(plan, choices), constrained)


def _prompt_rows(plan: StepPlan, choices: ChoiceTable) -> dict[str, int]:
    """Prompt positions whose logits this step must return, per sequence collecting prompt
    log-probs: its chunk's positions before the prompt's last (whose logits sample)."""
    rows: dict[str, int] = {}
    if not choices.collecting:
        return rows
    by_seq = choices.by_seq
    for chunk in plan.chunks:
        req = by_seq[chunk.seq_id]
        if req.prompt_logprobs is None or not chunk.is_prefill:
            continue
        k = min(chunk.num_tokens, req.seq.num_prompt_tokens - 1 - chunk.start)
        if k > 0:
            rows[chunk.seq_id] = k
    return rows


def grammar_masks(grammars: Grammars, rows: SamplingRows) -> torch.Tensor | None:
    """The constrained rows' token bitmasks (None when no row has a grammar). Called while the
    forward runs: on a GPU the CPU is idle then (on a CPU: microseconds)."""
    if not rows.constrained:
        return None
    return grammars.masks([rows.reqs[j].matcher for j in rows.constrained])  # type: ignore[misc]


def sample_rows(
    logits: torch.Tensor,
    plan: StepPlan,
    rows: SamplingRows,
    choices: ChoiceTable,
    masks: torch.Tensor | None,
) -> StepResult:
    """The step's sampled token per sequence, and what the requests asked beside it."""
    reqs = rows.reqs
    result = StepResult()
    if rows.prompt_rows:
        collect_prompt_logprobs(plan, rows.prompt_rows, logits[len(reqs) :], choices)
        logits = logits[: len(reqs)]
    params = [r.params for r in reqs]
    if any(p.adjusts_logits for p in params):
        histories = [
            TokenHistory(
                r.seq.prompt_token_ids, r.seq.output_token_ids, r.seq.limits.stop_token_ids
            )
            for r in reqs
        ]
        logits = adjust_logits(logits, params, histories)
    if masks is not None:
        logits = apply_masks(logits, rows.constrained, masks)
    # A draw's position is its output index, so a resumed request continues its stream.
    tokens = sample(logits, params, [r.seq.num_output_tokens for r in reqs])
    if any(p.logprobs is not None for p in params):
        found = token_logprobs(logits, tokens, [p.logprobs for p in params])
        result.logprobs = {i: lp for i, lp in zip(rows.seq_ids, found, strict=True) if lp}
    for j in rows.constrained:
        matcher = reqs[j].matcher
        assert matcher is not None
        # A token the mask allowed is always accepted; a refused one (every token masked,
        # e.g. min_tokens holding back the only end the grammar leaves) ends the request.
        if not matcher.consume_token(tokens[j]) or matcher.is_stopped():
            result.grammar_done.add(rows.seq_ids[j])
    result.sampled = dict(zip(rows.seq_ids, tokens, strict=True))
    return result


def collect_prompt_logprobs(
    plan: StepPlan, prompt_rows: dict[str, int], logits: torch.Tensor, choices: ChoiceTable
) -> None:
    """Collect the log-prob of each prompt token under the raw logits of the position
    before it (sent with the request's first output)."""
    by_seq = choices.by_seq
    chunks = [c for c in plan.chunks if c.seq_id in prompt_rows]
    targets, counts = [], []
    for c in chunks:
        prompt = by_seq[c.seq_id].seq.prompt_token_ids
        targets += prompt[c.start + 1 : c.start + 1 + prompt_rows[c.seq_id]]
        counts += [by_seq[c.seq_id].params.prompt_logprobs] * prompt_rows[c.seq_id]
    found = token_logprobs(logits, targets, counts)
    at = 0
    for c in chunks:
        collected = by_seq[c.seq_id].prompt_logprobs
        assert collected is not None
        k = prompt_rows[c.seq_id]
        # A recompute (after a preemption) computes positions again: keep the first.
        for position, lp in enumerate(found[at : at + k], start=c.start):
            if position == len(collected):
                collected.append(lp)  # type: ignore[arg-type]
        at += k
