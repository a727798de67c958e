"""The engine: a model on a paged KV cache, driven step by step by a batching policy.

Usable offline (`generate`) and by the service's engine loop (`add_request` / `step` / `abort`).
One step = schedule -> run (one forward pass over the mixed batch) -> postprocess.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from engine.capacity import KVCapacity, budget_bytes, plan_capacity
from engine.config import EngineConfig
from engine.decode_graphs import CudaGraphCapture, graph_reserved_bytes
from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.memory_profile import step_peak_bytes
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.sampling import (
    TokenHistory,
    TokenLogprobs,
    adjust_logits,
    choice_seed,
    sample,
    token_logprobs,
    with_seed,
)
from engine.step_timing import PhaseClock, StepTiming, sync_device
from engine.structured import Grammars, apply_masks
from engine.triton_decode import DecodeShape, resolve_decode_attention
from protocol.detokenizer import IncrementalDetokenizer
from protocol.sampling import SamplingParams
from scheduler import (
    BlockIntegrityError,
    KVBlockManager,
    SchedulerStats,
    Sequence,
    SequenceStatus,
    StepPlan,
    make_policy,
)

if TYPE_CHECKING:  # llguidance is imported only when a request has a grammar
    from llguidance import LLMatcher

logger = logging.getLogger("jitney.engine")


class RequestTooLongError(ValueError):
    """prompt + max_tokens exceed the context window."""


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
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    # Each prompt token's after the first, in the request's first output (when it asked).
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class _Request:
    """Per-request state the worker keeps beside the scheduler's Sequence."""

    seq: Sequence
    params: SamplingParams  # seeded if it samples (engine.sampling.with_seed)
    detok: IncrementalDetokenizer | None  # None: token ids only (params.detokenize is False)
    request_id: str = ""
    index: int = 0  # the choice (params.n)
    matcher: LLMatcher | None = None  # its grammar's state (params.grammar)
    # Prompt log-probs collected so far (positions 1..), until sent with the first output.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Choices 1.. of a fresh request, queued once this (choice 0) has its prompt computed.
    held: list[_Request] = field(default_factory=list)


@dataclass(slots=True)
class _StepResult:
    """What one forward pass and its sampling produced."""

    sampled: dict[str, int]  # the token of every sequence that sampled
    logprobs: dict[str, TokenLogprobs]  # of those that asked
    grammar_done: set[str]  # sequences whose grammar is complete with this token


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        progress: Callable[[str], None] | None = None,
    ):
        self.config = config
        self.device = config.torch_device
        self.loaded = loaded or load_model(
            config.model,
            self.device,
            config.torch_dtype,
            config.cache_dir,
            progress,
            noop_step_ms=config.noop_step_ms,
        )
        model = self.loaded.model
        spec = KVCacheSpec(
            self.loaded.num_layers,
            self.loaded.num_kv_heads,
            self.loaded.head_dim,
            model.dtype,
            config.block_size,
        )
        step_peak = None
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        shape = DecodeShape(
            getattr(model.config, "num_attention_heads", spec.num_kv_heads),
            spec.num_kv_heads,
            spec.head_dim,
            spec.block_size,
            spec.dtype,
        )
        decode_kernel, why_not = resolve_decode_attention(
            config.decode_attention, self.device, shape
        )
        self.decode_kernel_unused_because = why_not  # (bench/gpu_check.py reports it)
        if why_not is not None and self.device.type == "cuda":
            logger.warning("decode attention: gather (%s)", why_not)
        if self.device.type == "cuda" and config.kv_cache_memory is None:
            # What the largest step needs beside the cache, measured (engine/memory_profile.py),
            # and what decode graphs keep: their shared logits buffer and, unless the kernel
            # reads K/V in place, the read workspace (at most the longest context's).
            step_peak = step_peak_bytes(
                model, spec, config.max_num_batched_tokens, config.max_num_seqs, decode_kernel
            )
            if use_graphs:
                longest = config.max_model_len or self.loaded.max_model_len
                step_peak += graph_reserved_bytes(
                    spec, config.max_num_seqs, longest, self.vocab_size, decode_kernel
                )
        budget = budget_bytes(config, self.device, step_peak)
        self.capacity: KVCapacity = plan_capacity(config, spec, self.loaded.max_model_len, budget)
        # One source of truth: the blocks the memory budget yields are the scheduler's budget.
        # One block more than the scheduler's: the scratch block padded decode rows write to.
        self.kv_cache = PagedKVCache(spec, self.capacity.num_blocks + 1, self.device, decode_kernel)
        self.block_manager = KVBlockManager(
            self.capacity.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.policy = make_policy(config.batching, config.scheduler_config(), self.block_manager)
        self.runner = ModelRunner(model, self.kv_cache)
        if use_graphs:
            self.runner.enable_decode_graphs(
                config.max_num_seqs, self.max_model_len, CudaGraphCapture()
            )
        self.requests: dict[str, _Request] = {}  # by sequence: one per choice of a request
        self.choices: dict[str, list[str]] = {}  # request id -> its choices' sequence ids
        # Sequences with a grammar, and those still collecting prompt log-probs: most steps
        # have neither, and then skip looking for them (a loop over the batch each).
        self._constrained: set[str] = set()
        self._collecting: set[str] = set()
        self._holding: set[str] = set()  # choice 0 of requests whose other choices wait on it
        self.eos_token_ids = tuple(self.loaded.eos_token_ids)
        self.grammars = Grammars(self.loaded.tokenizer, self.vocab_size, self.eos_token_ids)
        self.last_step_timing = StepTiming()  # the phases of the last step (the worker exports)
        self.last_idle_check_s = 0.0  # the pool check the last step ran if it left us idle
        if progress is not None:
            progress(self.capacity.table())

    @property
    def decode_attention(self) -> str:
        """What decode tokens attend through: "triton" (in place) or "gather"."""
        return "triton" if self.kv_cache.decode_kernel else "gather"

    @property
    def max_model_len(self) -> int:
        return self.capacity.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.loaded.model.get_input_embeddings().num_embeddings

    # ----- state the service loop reads (admission control, metrics) -----------------------
    @property
    def stats(self) -> SchedulerStats:
        """Filled by the scheduler when it plans a step; running/waiting are as planned."""
        return self.policy.stats

    @property
    def num_running(self) -> int:
        """Requests holding a batch slot now."""
        return len(self.policy.slot_holders())

    @property
    def num_waiting(self) -> int:
        """Added but not admitted (or preempted back to waiting)."""
        return len(self.policy.waiting)

    def preemptible_priority(self) -> int | None:
        """The priority a more urgent new request would preempt for (continuous batching): the
        least urgent holding a slot. None when nothing runs, or when a waiting request is already
        more urgent than it (the next steps preempt for that one first)."""
        holders = self.policy.slot_holders()
        if not holders or self.config.batching != "continuous":
            return None
        least_urgent = max(seq.priority for seq in holders)
        waiting = self.policy.waiting
        if waiting and waiting.peek().priority < least_urgent:
            return None
        return least_urgent

    def first_scheduled_time(self, request_id: str) -> float | None:
        """When the request was first scheduled (time.monotonic()), None if not yet or unknown."""
        req = self.requests.get(request_id)
        return None if req is None else req.seq.first_scheduled_time

    # ----- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_token_ids: list[int] | Mapping[int, list[int]] | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. Raises RequestTooLongError or InfeasibleRequestError (ValueErrors).

        `priority`: vLLM's, lower is served first (every choice has it); under continuous
        batching a more urgent request may preempt less urgent running ones to get in.

        `output_token_ids`: tokens another worker already generated and delivered (a takeover).
        The request continues after them: their K/V is recomputed, the detokenizer replays them
        (so only text after them is emitted) and seeded sampling resumes at their position.
        With `params.detokenize` off, outputs carry token ids only and stop strings are the
        caller's: it aborts the request when it finds one.

        `params.n` > 1: choice 0 is queued; choices 1.. join at the front of the queue once its
        prompt is computed, so their prompt blocks are the prefix cache's (allocated once). A
        taken-over request with choices gives a mapping, choice -> delivered tokens, of the
        choices that had not finished (the others are not run again).
        """
        if isinstance(output_token_ids, Mapping):
            resumed = {i: list(tokens) for i, tokens in output_token_ids.items()}
        else:
            resumed = {i: [] for i in range(params.n)}
            resumed[0] = list(output_token_ids or ())
        if not resumed or not all(0 <= i < params.n for i in resumed):
            raise ValueError(f"resumed choices {sorted(resumed)} do not fit n={params.n}")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the context window of {self.max_model_len} tokens"
            )
        if any(token >= self.vocab_size for token, _ in params.logit_bias):
            raise ValueError(
                f"logit_bias names token ids outside the vocabulary (size {self.vocab_size})"
            )
        if request_id in self.choices:
            raise ValueError(f"duplicate request id {request_id!r}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        reqs = [
            self._choice(request_id, i, prompt_token_ids, params, arrival, tokens, priority)
            for i, tokens in sorted(resumed.items())
        ]  # every choice is built (and checked) before any is queued
        fresh = not any(resumed.values())
        first, later = (reqs[0], reqs[1:]) if fresh else (None, reqs)
        for req in reqs if first is None else [first]:
            self.policy.add_request(req.seq)
        if first is not None and later:
            first.held = later  # queued once choice 0's prompt is computed
            self._holding.add(first.seq.seq_id)
        for req in reqs:
            self.requests[req.seq.seq_id] = req
            if req.matcher is not None:
                self._constrained.add(req.seq.seq_id)
            if req.prompt_logprobs is not None:
                self._collecting.add(req.seq.seq_id)
        self.choices[request_id] = [req.seq.seq_id for req in reqs]

    def _choice(
        self,
        request_id: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        arrival: float,
        resumed: list[int],
        priority: int,
    ) -> _Request:
        """One choice's sequence and state (not queued yet)."""
        if index:
            params = replace(params, seed=choice_seed(params.seed, index), prompt_logprobs=None)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        seq_id = request_id if index == 0 else f"{request_id}#{index}"
        seq = Sequence.create(
            seq_id, prompt, params.max_tokens, arrival, sorted(stop_ids), resumed, priority
        )
        detok = None
        if params.detokenize:
            detok = IncrementalDetokenizer.create(self.loaded.tokenizer, prompt, params.stop)
            for token in resumed:
                detok.add(token)
        req = _Request(seq, with_seed(params), detok, request_id, index)
        if params.grammar is not None:  # GrammarError (a ValueError) before anything is queued
            req.matcher = self.grammars.matcher(params.grammar, resumed)
        # A resumed request's first reply, sent by another worker, had them already.
        if params.prompt_logprobs is not None and not resumed:
            req.prompt_logprobs = []
            seq.uses_prefix_cache = False  # every prompt position must yield logits
        return req

    def abort(self, request_id: str, index: int | None = None) -> list[RequestOutput]:
        """End a request now (or one of its choices); its KV blocks are free when this returns.
        The final output of every choice that was still running (none if it was unknown)."""
        seq_ids = self.choices.get(request_id, [])
        if index is not None:
            seq_ids = [i for i in seq_ids if self.requests[i].index == index]
        finals = []
        now = time.monotonic()
        for seq_id in list(seq_ids):
            req = self.requests[seq_id]
            if seq_id in self.policy.seqs:
                if self.policy.abort(seq_id, now) is None:
                    continue  # finished already (a static batch holds finished sequences)
                self._release_held(req)  # the other choices go on (unless aborted next)
            else:  # held back behind choice 0, never queued
                self.requests[req.request_id].held.remove(req)
                req.seq.set_status(SequenceStatus.FINISHED_ABORTED)
            finals.append(self._final_output(self._forget(seq_id)))
        return finals

    def _forget(self, seq_id: str) -> _Request:
        """Drop a finished or aborted choice; the request goes with its last choice."""
        req = self.requests.pop(seq_id)
        self._constrained.discard(seq_id)
        self._collecting.discard(seq_id)
        seq_ids = self.choices[req.request_id]
        seq_ids.remove(seq_id)
        if not seq_ids:
            del self.choices[req.request_id]
        return req

    def _release_held(self, req: _Request) -> None:
        """Queue the choices held back until `req`'s prompt was computed (or it ended)."""
        for later in reversed(req.held):
            self.policy.add_request(later.seq, front=True)
        req.held = []
        self._holding.discard(req.seq.seq_id)

    def reset(self) -> None:
        """Drop every request (after a failed step, or when they were handed to another worker).
        A step that raised may have left the scheduler half-updated: if the block accounting no
        longer adds up, start from a fresh pool and policy (the KV tensors are reused)."""
        failed = []
        for request_id in list(self.choices):
            try:
                self.abort(request_id)
            except Exception:  # a half-updated sequence: its scheduler state cannot be trusted
                logger.exception("abort_failed request=%s (engine reset)", request_id)
                failed.append(request_id)
        # What an abort left behind (a failed one, a finished static-batch mate) goes too.
        self.requests.clear()
        self.choices.clear()
        self._constrained.clear()
        self._collecting.clear()
        self._holding.clear()
        broken = f"aborting {failed} raised" if failed else self._unreusable_state()
        if broken is not None:
            logger.warning("engine state rebuilt after a failed step: %s", broken)
            config = self.config
            self.block_manager = KVBlockManager(
                self.capacity.num_blocks, config.block_size, config.enable_prefix_caching
            )
            self.policy = make_policy(
                config.batching, config.scheduler_config(), self.block_manager
            )

    def _unreusable_state(self) -> str | None:
        """Why the scheduler and block pool cannot be reused once every request is aborted."""
        if self.policy.seqs:
            return f"{len(self.policy.seqs)} sequences left after aborting them all"
        if self.block_manager.num_used_blocks:
            return f"{self.block_manager.num_used_blocks} blocks still used"
        try:
            self.block_manager.check_integrity()
        except BlockIntegrityError as e:
            return str(e)
        return None

    def has_unfinished(self) -> bool:
        return self.policy.has_unfinished()

    def flush(self) -> None:
        """No more requests will come (offline runs): static batching launches a partial batch."""
        self.policy.flush()

    # ----- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        clock = PhaseClock()
        plan = self.policy.schedule(time.monotonic())
        clock.lap("schedule")
        result = self._run(plan, clock) if not plan.is_empty else _StepResult({}, {}, set())
        deltas = self._detokenize(result)
        outputs = self._postprocess(plan, result.sampled, deltas, result.grammar_done)
        clock.lap("postprocess")
        self.last_step_timing = clock.timing
        self.last_idle_check_s = 0.0
        if not self.policy.has_unfinished():
            # Idle is when a leak would show. O(pool blocks), once per idle period (29 ms for a
            # 1 GiB pool of tiny-random blocks), so outside the per-step phases it would skew;
            # timed on its own, so a bench can leave it out of its per-step figures.
            start = time.perf_counter()
            self.block_manager.check_integrity()
            self.last_idle_check_s = time.perf_counter() - start
        return outputs

    def _run(self, plan: StepPlan, clock: PhaseClock) -> _StepResult:
        """The step's sampled token per sequence, and what the requests asked beside it."""
        requests = self.requests
        sampling_ids = [c.seq_id for c in plan.chunks if c.samples]
        reqs = [requests[i] for i in sampling_ids]
        prompt_rows = self._prompt_rows(plan)
        inputs = self.runner.prepare(
            plan, self.policy.seqs, self.block_manager.block_ids, prompt_rows
        )
        clock.lap("prepare")
        logits = self.runner.forward(inputs)
        constrained = []
        if self._constrained:
            constrained = [j for j, r in enumerate(reqs) if r.matcher is not None]
        masks = None
        if constrained:  # on a GPU the forward still runs meanwhile (on a CPU: microseconds)
            masks = self.grammars.masks([reqs[j].matcher for j in constrained])  # type: ignore[misc]
        sync_device(self.device)  # the forward's lap ends when its kernels do (step_timing.py)
        clock.lap("forward")
        result = _StepResult({}, {}, set())
        if prompt_rows:
            self._collect_prompt_logprobs(plan, prompt_rows, logits[len(reqs) :])
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
            logits = apply_masks(logits, constrained, masks)
        # A draw's position is its output index, so a resumed request continues its stream.
        tokens = sample(logits, params, [r.seq.num_output_tokens for r in reqs])
        if any(p.logprobs is not None for p in params):
            found = token_logprobs(logits, tokens, [p.logprobs for p in params])
            result.logprobs = {i: lp for i, lp in zip(sampling_ids, found, strict=True) if lp}
        for j in constrained:
            matcher = reqs[j].matcher
            assert matcher is not None
            # A token the mask allowed is always accepted; a refused one (every token masked,
            # e.g. min_tokens holding back the only end the grammar leaves) ends the request.
            if not matcher.consume_token(tokens[j]) or matcher.is_stopped():
                result.grammar_done.add(sampling_ids[j])
        clock.lap("sample")
        result.sampled = dict(zip(sampling_ids, tokens, strict=True))
        return result

    def _prompt_rows(self, plan: StepPlan) -> dict[str, int]:
        """Prompt positions whose logits this step must return, per sequence collecting prompt
        log-probs: its chunk's positions before the prompt's last (whose logits sample)."""
        rows: dict[str, int] = {}
        if not self._collecting:
            return rows
        requests = self.requests
        for chunk in plan.chunks:
            req = requests[chunk.seq_id]
            if req.prompt_logprobs is None or not chunk.is_prefill:
                continue
            k = min(chunk.num_tokens, req.seq.num_prompt_tokens - 1 - chunk.start)
            if k > 0:
                rows[chunk.seq_id] = k
        return rows

    def _collect_prompt_logprobs(
        self, plan: StepPlan, prompt_rows: dict[str, int], logits: torch.Tensor
    ) -> None:
        """Collect the log-prob of each prompt token under the raw logits of the position
        before it (sent with the request's first output)."""
        chunks = [c for c in plan.chunks if c.seq_id in prompt_rows]
        targets, counts = [], []
        for c in chunks:
            prompt = self.requests[c.seq_id].seq.prompt_token_ids
            targets += prompt[c.start + 1 : c.start + 1 + prompt_rows[c.seq_id]]
            counts += [self.requests[c.seq_id].params.prompt_logprobs] * prompt_rows[c.seq_id]
        found = token_logprobs(logits, targets, counts)
        at = 0
        for c in chunks:
            req = self.requests[c.seq_id]
            collected = req.prompt_logprobs
            assert collected is not None
            k = prompt_rows[c.seq_id]
            # A recompute (after a preemption) computes positions again: keep the first.
            for position, lp in enumerate(found[at : at + k], start=c.start):
                if position == len(collected):
                    collected.append(lp)  # type: ignore[arg-type]
            at += k

    def _detokenize(self, result: _StepResult) -> dict[str, RequestOutput]:
        """Each sampled token's output: its text delta (a stop string found ends its request in
        update) and its log-probs when asked."""
        outputs: dict[str, RequestOutput] = {}
        requests = self.requests
        logprobs = result.logprobs
        for seq_id, token in result.sampled.items():
            req = requests[seq_id]
            detok = req.detok
            out = outputs[seq_id] = RequestOutput(req.request_id, [token], req.index)
            if detok is not None:
                out.delta_text = detok.add(token)
            if logprobs and (lp := logprobs.get(seq_id)) is not None:
                out.logprobs = [lp]
            out.num_output_tokens = req.seq.num_output_tokens + 1
            if req.prompt_logprobs is not None:  # complete: the first token samples after them
                out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
                self._collecting.discard(seq_id)
        return outputs

    def _postprocess(
        self,
        plan: StepPlan,
        sampled: dict[str, int],
        outputs: dict[str, RequestOutput],
        stopped: set[str],
    ) -> list[RequestOutput]:
        """Finish what ended: a stop string (`stopped` already holds completed grammars)."""
        requests = self.requests
        stopped |= {
            seq_id
            for seq_id in outputs
            if (detok := requests[seq_id].detok) is not None and detok.stopped
        }
        for seq_id in [i for i in self._holding if i in sampled]:
            self._release_held(requests[seq_id])  # its prompt is computed: the others may start
        for seq in self.policy.update(plan, sampled, stopped, time.monotonic()):
            final = self._final_output(self._forget(seq.seq_id))
            delta = outputs.pop(seq.seq_id, None)
            if delta is not None:
                final.new_token_ids = delta.new_token_ids
                final.logprobs = delta.logprobs
                final.prompt_logprobs = delta.prompt_logprobs
                final.delta_text = delta.delta_text + final.delta_text
            outputs[seq.seq_id] = final
        return list(outputs.values())

    def _final_output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            req.request_id,
            index=req.index,
            delta_text="" if req.detok is None else req.detok.finish(),
            finished=True,
            finish_reason=seq.status.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # ----- offline -------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[CompletedRequest]:
        """Run prompts to completion on an idle engine; results in input order."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; use add_request/step instead")
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if any(p.n > 1 for p in params_list):
            raise ValueError("generate() returns one result per prompt: use add_request for n > 1")
        results = {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            rid = f"offline-{i}"
            self.add_request(rid, prompt, p)
            results[rid] = CompletedRequest(rid, list(prompt))
        self.flush()
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].absorb(out)
        return list(results.values())


@dataclass(slots=True)
class CompletedRequest:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # when the request asked

    def absorb(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.delta_text
        self.logprobs += out.logprobs or ()
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.num_cached_tokens = out.num_cached_tokens
