"""After the forward: the step's logits become one token per sampling row, and what rows asked.

In step order, for the rows of the choices that sample (in chunk order):
1. before the forward: which prompt positions must return logits too (prompt log-probs);
2. while the forward runs: the grammar masks of the constrained rows (engine/grammar_masks.py);
3. after it: the prompt rows' log-probs collected, then penalties, bias and min_tokens
   (`adjust_logits`), the grammar masks, the pick (`sample`), each token's log-probs when asked,
   and every grammar advanced by its token (a completed or refused one ends its request).
A step with verifications picks its draft rows in the same pass, each as plain decoding would
pick that position, and keeps each verifying sequence's drafts up to the first pick that differs
(engine/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.choices import ChoiceState, ChoiceTable
from engine.grammar_masks import Grammars, apply_masks
from engine.sampler import TokenLogprobs, adjust_logits, sample, token_logprobs
from engine.speculative import PickRows, draft_rows, grammar_cut, verify
from scheduler import StepPlan


@dataclass(slots=True)
class StepResult:
    """What one forward pass and its sampling produced."""

    sampled: dict[str, int] = field(default_factory=dict)  # the token of every sequence sampled
    # Of those that asked: one per token of the step (the accepted drafts', then the sampled's).
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    grammar_done: set[str] = field(default_factory=set)  # grammar complete with this token
    # Verifying sequences' accepted drafts, output before their sampled token.
    accepted: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class SamplingRows:
    """The step's sampling rows: the logits' first len(seq_ids) rows, in chunk order."""

    seq_ids: list[str]
    reqs: list[ChoiceState]
    # Sequence id -> prompt positions (from its chunk's start) whose logits follow the rows.
    prompt_rows: dict[str, int]
    constrained: list[int]  # the rows with a grammar (of `picks`' rows, with drafts)
    # Verifying sequence id -> its draft count: its chunk's first k positions' logits follow
    # the rows too (engine/speculative.py), in chunk order with the prompt rows.
    draft_rows: dict[str, int] = field(default_factory=dict)
    # The sampling rows then (with drafts) the draft rows, each picked as its position's own.
    picks: PickRows = field(default_factory=PickRows)

    @property
    def extra_rows(self) -> dict[str, int]:
        """Every chunk's leading positions whose logits follow the sampling rows."""
        if not self.draft_rows:
            return self.prompt_rows
        return {**self.prompt_rows, **self.draft_rows}


def sampling_rows(plan: StepPlan, choices: ChoiceTable) -> SamplingRows:
    """The rows a step's logits will hold, and which of them need more than a pick."""
    seq_ids = [c.seq_id for c in plan.chunks if c.samples]
    reqs = [choices.by_seq[i] for i in seq_ids]
    drafts = draft_rows(plan)
    picks = PickRows.of(reqs, seq_ids, drafts)
    constrained = picks.constrained() if choices.constrained else []
    return SamplingRows(seq_ids, reqs, _prompt_rows(plan, choices), constrained, drafts, picks)


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
    picks = rows.picks
    matchers = [picks.reqs[r].matcher for r in rows.constrained]
    after = [picks.drafts_before(r) for r in rows.constrained] if rows.draft_rows else None
    return grammars.masks(matchers, after)  # type: ignore[arg-type]


def sample_rows(
    logits: torch.Tensor,
    plan: StepPlan,
    rows: SamplingRows,
    choices: ChoiceTable,
    masks: torch.Tensor | None,
) -> StepResult:
    """The step's sampled token per sequence, and what the requests asked beside it."""
    reqs = rows.reqs
    every_row = logits
    prompt_logits, draft_logits = _extra_logits(plan, rows, logits[len(reqs) :])
    logits = logits[: len(reqs)]
    if rows.prompt_rows:
        collect_prompt_logprobs(plan, rows.prompt_rows, prompt_logits, choices)
    picks = rows.picks
    if rows.draft_rows:  # the draft rows are picked with the sampling rows, each as its own
        # Without prompt rows the forward's rows are already these, in this order; copying them
        # (1.5 MB for SmolLM2's 8 rows) took 0.12 ms of a 7-draft step (docs/notes/speculation.md).
        logits = every_row if not rows.prompt_rows else torch.cat([logits, draft_logits])
    params = picks.params()
    if any(p.adjusts_logits for p in params):
        logits = adjust_logits(logits, params, picks.histories())
    if masks is not None:
        logits = apply_masks(logits, rows.constrained, masks)
    # A draw's position is its output index, so a resumed request continues its stream.
    tokens = sample(logits, params, picks.positions())
    found = None
    if any(p.logprobs is not None for p in params):
        found = token_logprobs(logits, tokens, [p.logprobs for p in params])
    if rows.draft_rows:
        return _verified(rows, picks, tokens, found)
    result = StepResult(sampled=dict(zip(rows.seq_ids, tokens, strict=True)))
    if found is not None:
        result.logprobs = {i: [lp] for i, lp in zip(rows.seq_ids, found, strict=True) if lp}
    for j in rows.constrained:
        if grammar_cut(reqs[j].matcher, tokens[j : j + 1]) is not None:  # type: ignore[arg-type]
            result.grammar_done.add(rows.seq_ids[j])
    return result


def _verified(
    rows: SamplingRows,
    picks: PickRows,
    tokens: list[int],
    found: list[TokenLogprobs | None] | None,
) -> StepResult:
    """A step with verifications: each sequence's drafts kept up to the first pick that
    differs, then that pick (engine/speculative.py)."""
    result = StepResult()
    for i, seq_id in enumerate(rows.seq_ids):
        step = verify(picks, i, tokens, found)
        result.sampled[seq_id] = step.tokens[-1]
        if picks.offsets[i]:
            result.accepted[seq_id] = step.tokens[:-1]
        if step.logprobs:
            result.logprobs[seq_id] = step.logprobs
        if step.grammar_done:
            result.grammar_done.add(seq_id)
    return result


def _extra_logits(
    plan: StepPlan, rows: SamplingRows, extra: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows after the sampling rows, split into the prompt rows' and the draft rows'
    (each in chunk order)."""
    if not rows.draft_rows or not rows.prompt_rows:
        return extra, extra
    prompt_at: list[int] = []
    draft_at: list[int] = []
    at = 0
    for chunk in plan.chunks:
        for wanted, into in ((rows.prompt_rows, prompt_at), (rows.draft_rows, draft_at)):
            if (k := wanted.get(chunk.seq_id)) is not None:
                into += range(at, at + k)
                at += k
    index = torch.tensor(prompt_at + draft_at, device=extra.device)
    picked = extra.index_select(0, index)
    return picked[: len(prompt_at)], picked[len(prompt_at) :]


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
