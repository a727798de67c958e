"""What the engine hands back: a `RequestOutput` per step and choice, `CompletedRequest` offline.

A step's sampled tokens become outputs here: each token's text delta (the detokenizer holds back
what may start a stop string; one found ends its request in the scheduler's update), its
log-probs when asked, and a request's prompt log-probs with its first output. A choice that
ended gets a final output, carrying the last delta of the step that ended it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.choices import ChoiceState, ChoiceTable
from engine.sampler import TokenLogprobs
from engine.sampling_pipeline import StepResult


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta), or its final state when finished."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    index: int = 0  # the choice (params.n > 1)
    delta_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # A final output's speculation totals (Sequence's): draft tokens verified, kept, verifications.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    # Each prompt token's after the first, in the request's first output (when it asked).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # A pooling request's final output: its prompt's vector (float32 [hidden], on the host,
    # not normalised; engine/pooling.py), and no tokens.
    embedding: torch.Tensor | None = None


def step_outputs(result: StepResult, choices: ChoiceTable) -> dict[str, RequestOutput]:
    """Each sampled token's output, by sequence id: its text delta and its log-probs."""
    outputs: dict[str, RequestOutput] = {}
    by_seq = choices.by_seq
    logprobs = result.logprobs
    for seq_id, token in result.sampled.items():
        req = by_seq[seq_id]
        detok = req.detok
        if seq_id in result.accepted:
            tokens, text = _verified_tokens(result, seq_id, req)
        else:
            tokens, text = [token], "" if detok is None else detok.add(token)
        out = outputs[seq_id] = RequestOutput(req.request_id, tokens, req.index, text)
        if logprobs and (lp := logprobs.get(seq_id)) is not None:
            out.logprobs = lp[: len(tokens)]  # (a stop inside a verified span cut the tokens)
        out.num_output_tokens = req.seq.num_output_tokens + len(tokens)
        if req.prompt_logprobs is not None:  # complete: the first token samples after them
            out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
            choices.collecting.discard(seq_id)
    return outputs


def _verified_tokens(result: StepResult, seq_id: str, req: ChoiceState) -> tuple[list[int], str]:
    """A verifying sequence's tokens of this step and their text, cut after the first that
    ends it (a stop token, or the end of a stop string): plain decoding stops there. The cut
    is written back into `result`, so the scheduler keeps the same tokens."""
    tokens = [*result.accepted[seq_id], result.sampled[seq_id]]
    stops, detok = req.seq.limits.stop_token_ids, req.detok
    text = []
    for n, token in enumerate(tokens, 1):
        if detok is not None:
            text.append(detok.add(token))
        if token in stops or (detok is not None and detok.stopped):
            del tokens[n:]
            break
    result.accepted[seq_id], result.sampled[seq_id] = tokens[:-1], tokens[-1]
    return tokens, "".join(text)


def stop_strings_found(outputs: dict[str, RequestOutput], choices: ChoiceTable) -> set[str]:
    """The sequences whose detokenizer found a stop string in this step's text."""
    by_seq = choices.by_seq
    return {
        seq_id
        for seq_id in outputs
        if (detok := by_seq[seq_id].detok) is not None and detok.stopped
    }


def final_output(req: ChoiceState, delta: RequestOutput | None = None) -> RequestOutput:
    """A finished or aborted choice's last output: with `delta`, the step's that ended it."""
    seq = req.seq
    final = RequestOutput(
        req.request_id,
        index=req.index,
        delta_text="" if req.detok is None else req.detok.finish(),
        finished=True,
        finish_reason=seq.status.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        num_draft_tokens=seq.speculation.num_draft_tokens,
        num_accepted_tokens=seq.speculation.num_accepted_tokens,
        num_verifications=seq.speculation.num_verifications,
    )
    if delta is not None:
        final.new_token_ids = delta.new_token_ids
        final.logprobs = delta.logprobs
        final.prompt_logprobs = delta.prompt_logprobs
        final.delta_text = delta.delta_text + final.delta_text
    return final


def pooled_output(final: RequestOutput, vector: torch.Tensor | None) -> RequestOutput:
    """A pooling request's final output: its vector in place of the token that ended it (a
    pooling request samples nothing it shows); without one (aborted), the final as it was."""
    if vector is None:
        return final
    final.embedding = vector
    final.new_token_ids, final.logprobs, final.delta_text = [], None, ""
    final.finish_reason, final.num_output_tokens = "stop", 0
    return final


@dataclass(slots=True)
class CompletedRequest:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculation: draft tokens verified, and those kept
    num_accepted_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # when the request asked
    embedding: torch.Tensor | None = None  # a pooling request's vector

    def absorb(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.delta_text
        self.logprobs += out.logprobs or ()
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.num_cached_tokens = out.num_cached_tokens
            self.num_draft_tokens = out.num_draft_tokens
            self.num_accepted_tokens = out.num_accepted_tokens
            self.embedding = out.embedding
