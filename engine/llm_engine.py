"""The engine: a model on a paged KV cache, driven step by step by a batching policy.

Usable offline (`generate`) and by the service's engine loop (`add_request` / `step` / `abort`).
One step = schedule -> run (one forward pass over the mixed batch) -> postprocess.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.capacity import KVCapacity, budget_bytes, plan_capacity
from engine.config import EngineConfig
from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.memory_profile import step_peak_bytes
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.sampling import (
    TokenHistory,
    TokenLogprobs,
    adjust_logits,
    sample,
    token_logprobs,
    with_seed,
)
from engine.step_timing import PhaseClock, StepTiming, sync_device
from protocol.detokenizer import IncrementalDetokenizer
from protocol.sampling import SamplingParams
from scheduler import (
    BlockIntegrityError,
    KVBlockManager,
    SchedulerStats,
    Sequence,
    StepPlan,
    make_policy,
)

logger = logging.getLogger("jitney.engine")


class RequestTooLongError(ValueError):
    """prompt + max_tokens exceed the context window."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta), or its final state when finished."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked


@dataclass(slots=True)
class _Request:
    """Per-request state the worker keeps beside the scheduler's Sequence."""

    seq: Sequence
    params: SamplingParams  # seeded if it samples (engine.sampling.with_seed)
    detok: IncrementalDetokenizer | None  # None: token ids only (params.detokenize is False)


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
            config.model, self.device, config.torch_dtype, config.cache_dir, progress
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
        if self.device.type == "cuda" and config.kv_cache_memory is None:
            # What the largest step needs beside the cache, measured (engine/memory_profile.py).
            step_peak = step_peak_bytes(
                model, spec, config.max_num_batched_tokens, config.max_num_seqs
            )
        budget = budget_bytes(config, self.device, step_peak)
        self.capacity: KVCapacity = plan_capacity(config, spec, self.loaded.max_model_len, budget)
        # One source of truth: the blocks the memory budget yields are the scheduler's budget.
        # One block more than the scheduler's: the scratch block padded decode rows write to.
        self.kv_cache = PagedKVCache(spec, self.capacity.num_blocks + 1, self.device)
        self.block_manager = KVBlockManager(
            self.capacity.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.policy = make_policy(config.batching, config.scheduler_config(), self.block_manager)
        self.runner = ModelRunner(model, self.kv_cache)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.enable_decode_graphs(config.max_num_seqs, self.max_model_len, capture=True)
        self.requests: dict[str, _Request] = {}
        self.eos_token_ids = tuple(self.loaded.eos_token_ids)
        self.last_step_timing = StepTiming()  # the phases of the last step (the worker exports)
        self.last_idle_check_s = 0.0  # the pool check the last step ran if it left us idle
        if progress is not None:
            progress(self.capacity.table())

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
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. Raises RequestTooLongError or InfeasibleRequestError (ValueErrors).

        `output_token_ids`: tokens another worker already generated and delivered (a takeover).
        The request continues after them: their K/V is recomputed, the detokenizer replays them
        (so only text after them is emitted) and seeded sampling resumes at their position.
        With `params.detokenize` off, outputs carry token ids only and stop strings are the
        caller's: it aborts the request when it finds one.
        """
        resumed = list(output_token_ids or ())
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
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        seq = Sequence.create(
            request_id,
            prompt_token_ids,
            params.max_tokens,
            time.monotonic() if arrival_time is None else arrival_time,
            sorted(stop_ids),
            resumed,
        )
        detok = None
        if params.detokenize:
            detok = IncrementalDetokenizer.create(
                self.loaded.tokenizer, prompt_token_ids, params.stop
            )
            for token in resumed:
                detok.add(token)
        self.policy.add_request(seq)
        self.requests[request_id] = _Request(seq, with_seed(params), detok)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; its KV blocks are free when this returns."""
        if self.policy.abort(request_id, time.monotonic()) is None:
            return None
        return self._final_output(self.requests.pop(request_id))

    def reset(self) -> None:
        """Drop every request (after a failed step, or when they were handed to another worker).
        A step that raised may have left the scheduler half-updated: if the block accounting no
        longer adds up, start from a fresh pool and policy (the KV tensors are reused)."""
        failed = []
        for request_id in list(self.requests):
            try:
                self.abort(request_id)
            except Exception:  # a half-updated sequence: its scheduler state cannot be trusted
                logger.exception("abort_failed request=%s (engine reset)", request_id)
                failed.append(request_id)
        # What an abort left behind (a failed one, a finished static-batch mate) goes too.
        self.requests.clear()
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
        sampled, logprobs = self._run(plan, clock) if not plan.is_empty else ({}, {})
        deltas = self._detokenize(sampled, logprobs)
        outputs = self._postprocess(plan, sampled, deltas)
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

    def _run(
        self, plan: StepPlan, clock: PhaseClock
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """The step's sampled token per sequence, and the log-probs of those that asked."""
        inputs = self.runner.prepare(plan, self.policy.seqs, self.block_manager.block_ids)
        clock.lap("prepare")
        logits = self.runner.forward(inputs)
        sync_device(self.device)  # the forward's lap ends when its kernels do (step_timing.py)
        clock.lap("forward")
        sampling_ids = [c.seq_id for c in plan.chunks if c.samples]
        reqs = [self.requests[i] for i in sampling_ids]
        params = [r.params for r in reqs]
        if any(p.adjusts_logits for p in params):
            histories = [
                TokenHistory(
                    r.seq.prompt_token_ids, r.seq.output_token_ids, r.seq.limits.stop_token_ids
                )
                for r in reqs
            ]
            logits = adjust_logits(logits, params, histories)
        # A draw's position is its output index, so a resumed request continues its stream.
        tokens = sample(logits, params, [r.seq.num_output_tokens for r in reqs])
        logprobs = {}
        if any(p.logprobs is not None for p in params):
            found = token_logprobs(logits, tokens, [p.logprobs for p in params])
            logprobs = {i: lp for i, lp in zip(sampling_ids, found, strict=True) if lp}
        clock.lap("sample")
        return dict(zip(sampling_ids, tokens, strict=True)), logprobs

    def _detokenize(
        self, sampled: dict[str, int], logprobs: dict[str, TokenLogprobs]
    ) -> dict[str, RequestOutput]:
        """Each sampled token's output: its text delta (a stop string found ends its request in
        update) and its log-probs when asked."""
        outputs: dict[str, RequestOutput] = {}
        requests = self.requests
        for seq_id, token in sampled.items():
            req = requests[seq_id]
            detok = req.detok
            out = outputs[seq_id] = RequestOutput(seq_id, [token])
            if detok is not None:
                out.delta_text = detok.add(token)
            if logprobs and (lp := logprobs.get(seq_id)) is not None:
                out.logprobs = [lp]
            out.num_output_tokens = req.seq.num_output_tokens + 1
        return outputs

    def _postprocess(
        self, plan: StepPlan, sampled: dict[str, int], outputs: dict[str, RequestOutput]
    ) -> list[RequestOutput]:
        requests = self.requests
        stopped = {
            seq_id
            for seq_id in outputs
            if (detok := requests[seq_id].detok) is not None and detok.stopped
        }
        for seq in self.policy.update(plan, sampled, stopped, time.monotonic()):
            final = self._final_output(self.requests.pop(seq.seq_id))
            delta = outputs.pop(seq.seq_id, None)
            if delta is not None:
                final.new_token_ids = delta.new_token_ids
                final.logprobs = delta.logprobs
                final.delta_text = delta.delta_text + final.delta_text
            outputs[seq.seq_id] = final
        return list(outputs.values())

    def _final_output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            seq.seq_id,
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

    def absorb(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.delta_text
        self.logprobs += out.logprobs or ()
        if out.finished:
            self.finish_reason = out.finish_reason
            self.num_cached_tokens = out.num_cached_tokens
