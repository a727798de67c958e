"""A request's n choices: one sequence each, fanned out so that their prompt is computed once.

Choice 0 of a fresh request is queued alone; choices 1.. are held back until its prompt has been
computed (it sampled its first token), then join at the front of the queue: admitted next, they
find its prompt blocks in the prefix cache (allocated once). Each choice samples a stream of its
own (`choice_seed`); only choice 0 collects prompt log-probs. A request taken over from another
worker queues every unfinished choice at once, each after the tokens already delivered for it.

`ChoiceTable` holds every live choice of the engine by sequence id, with the indexes a step reads
instead of looping over the batch: which choices have a grammar, which still collect prompt
log-probs, which hold others back.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.errors import EmptyPromptError, ResumedOutputError
from engine.grammar_masks import Grammars
from engine.sampler import TokenLogprobs, choice_seed, with_seed
from generation.detokenizer import IncrementalDetokenizer
from generation.sampling_params import SamplingParams
from scheduler import BatchingPolicy, Sequence, SequenceStatus
from scheduler.speculation.prediction import Prediction

if TYPE_CHECKING:  # llguidance is imported only when a request has a grammar
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerFast


@dataclass(slots=True)
class ChoiceState:
    """Per-choice state the engine keeps beside the scheduler's Sequence."""

    seq: Sequence
    params: SamplingParams  # seeded if it samples (engine.sampler.with_seed)
    detok: IncrementalDetokenizer | None  # None: token ids only (params.detokenize is False)
    request_id: str = ""
    index: int = 0  # the choice (params.n)
    matcher: LLMatcher | None = None  # its grammar's state (params.grammar)
    # Prompt log-probs collected so far (positions 1..), until sent with the first output.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Choices 1.. of a fresh request, queued once this (choice 0) has its prompt computed.
    held: list[ChoiceState] = field(default_factory=list)


def resumed_choices(
    params: SamplingParams, output_token_ids: list[int] | Mapping[int, list[int]] | None
) -> dict[int, list[int]]:
    """Choice -> the tokens it continues after: every choice of a fresh request (choice 0 after
    `output_token_ids` when a list), or the choices a takeover's mapping names."""
    if isinstance(output_token_ids, Mapping):
        resumed = {i: list(tokens) for i, tokens in output_token_ids.items()}
    else:
        resumed = {i: [] for i in range(params.n)}
        resumed[0] = list(output_token_ids or ())
    if not resumed or not all(0 <= i < params.n for i in resumed):
        raise ResumedOutputError(f"resumed choices {sorted(resumed)} do not fit n={params.n}")
    return resumed


def choice_seq_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(frozen=True, slots=True)
class ChoiceFactory:
    """Builds one choice's sequence and state (not queued yet)."""

    tokenizer: PreTrainedTokenizerFast
    eos_token_ids: tuple[int, ...]
    grammars: Grammars

    def build(
        self,
        request_id: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        arrival: float,
        resumed: list[int],
        priority: int,
        adapter: str | None = None,
    ) -> ChoiceState:
        if index:
            params = replace(params, seed=choice_seed(params.seed, index), prompt_logprobs=None)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        seq_id = choice_seq_id(request_id, index)
        # What Sequence.create would refuse (as plain ValueErrors), refused as the caller's.
        if len(resumed) >= params.max_tokens:
            n = len(resumed)
            raise ResumedOutputError(
                f"{seq_id!r}: {n} output tokens already, max_tokens {params.max_tokens}"
            )
        if not prompt:
            raise EmptyPromptError(f"sequence {seq_id!r} has an empty prompt")
        seq = Sequence.create(
            seq_id, prompt, params.max_tokens, arrival, sorted(stop_ids), resumed, priority, adapter
        )
        detok = None
        if params.detokenize:
            detok = IncrementalDetokenizer.create(self.tokenizer, prompt, params.stop)
            for token in resumed:
                detok.add(token)
        seq.speculation.enabled = True  # every kind of row verifies exactly (engine/speculative.py)
        if params.prediction_token_ids:
            seq.speculation.prediction = Prediction(params.prediction_token_ids)
        req = ChoiceState(seq, with_seed(params), detok, request_id, index)
        if params.grammar is not None:  # GrammarError before anything is queued
            req.matcher = self.grammars.matcher(params.grammar, resumed)
        # A resumed request's first reply, sent by another worker, had them already.
        if params.prompt_logprobs is not None and not resumed:
            req.prompt_logprobs = []
            seq.uses_prefix_cache = False  # every prompt position must yield logits
        return req


@dataclass(slots=True)
class ChoiceTable:
    by_seq: dict[str, ChoiceState] = field(default_factory=dict)  # one per choice of a request
    by_request: dict[str, list[str]] = field(default_factory=dict)  # -> its choices' seq ids
    # Choices with a grammar, and those still collecting prompt log-probs: most steps have
    # neither, and then skip looking for them (a loop over the batch each).
    constrained: set[str] = field(default_factory=set)
    collecting: set[str] = field(default_factory=set)
    holding: set[str] = field(default_factory=set)  # choice 0 of requests whose others wait on it

    def add(self, reqs: list[ChoiceState], policy: BatchingPolicy) -> None:
        """Queue a request's choices (`reqs`, in index order, every one built): a fresh
        request's choice 0 alone, holding the others back; a resumed request's all at once."""
        fresh = not any(r.seq.num_output_tokens for r in reqs)
        first, later = (reqs[0], reqs[1:]) if fresh else (None, reqs)
        for req in reqs if first is None else [first]:
            policy.add_request(req.seq)
        if first is not None and later:
            first.held = later  # queued once choice 0's prompt is computed
            self.holding.add(first.seq.seq_id)
        for req in reqs:
            self.by_seq[req.seq.seq_id] = req
            if req.matcher is not None:
                self.constrained.add(req.seq.seq_id)
            if req.prompt_logprobs is not None:
                self.collecting.add(req.seq.seq_id)
        self.by_request[reqs[0].request_id] = [req.seq.seq_id for req in reqs]

    def release_computed(self, sampled: Collection[str], policy: BatchingPolicy) -> None:
        """Queue the choices held back by those that sampled: their prompt is computed."""
        for seq_id in [i for i in self.holding if i in sampled]:
            self.release_held(self.by_seq[seq_id], policy)

    def release_held(self, req: ChoiceState, policy: BatchingPolicy) -> None:
        """Queue the choices held back until `req`'s prompt was computed (or it ended)."""
        for later in reversed(req.held):
            policy.add_request(later.seq, front=True)
        req.held = []
        self.holding.discard(req.seq.seq_id)

    def abort(
        self, request_id: str, index: int | None, policy: BatchingPolicy, now: float
    ) -> list[ChoiceState]:
        """End a request's choices (or the one `index`) that were still running; returns them,
        forgotten. The other choices of the request go on."""
        seq_ids = self.by_request.get(request_id, [])
        if index is not None:
            seq_ids = [i for i in seq_ids if self.by_seq[i].index == index]
        ended = []
        for seq_id in list(seq_ids):
            req = self.by_seq[seq_id]
            if seq_id in policy.seqs:
                if policy.abort(seq_id, now) is None:
                    continue  # finished already (a static batch holds finished sequences)
                self.release_held(req, policy)  # the other choices go on (unless aborted next)
            else:  # held back behind choice 0, never queued
                self.by_seq[req.request_id].held.remove(req)
                req.seq.set_status(SequenceStatus.FINISHED_ABORTED)
            ended.append(self.forget(seq_id))
        return ended

    def forget(self, seq_id: str) -> ChoiceState:
        """Drop a finished or aborted choice; the request goes with its last choice."""
        req = self.by_seq.pop(seq_id)
        self.constrained.discard(seq_id)
        self.collecting.discard(seq_id)
        seq_ids = self.by_request[req.request_id]
        seq_ids.remove(seq_id)
        if not seq_ids:
            del self.by_request[req.request_id]
        return req

    def clear(self) -> None:
        self.by_seq.clear()
        self.by_request.clear()
        self.constrained.clear()
        self.collecting.clear()
        self.holding.clear()
