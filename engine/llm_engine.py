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
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.sampling import SamplerState, SamplingParams, sample
from scheduler import KVBlockManager, SchedulerStats, Sequence, StepPlan, make_policy

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


@dataclass(slots=True)
class _Request:
    """Per-request state the worker keeps beside the scheduler's Sequence."""

    seq: Sequence
    sampler: SamplerState
    detok: IncrementalDetokenizer


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
        budget = budget_bytes(config, self.device)
        self.capacity: KVCapacity = plan_capacity(config, spec, self.loaded.max_model_len, budget)
        # One source of truth: the blocks the memory budget yields are the scheduler's budget.
        self.kv_cache = PagedKVCache(spec, self.capacity.num_blocks, self.device)
        self.block_manager = KVBlockManager(
            self.capacity.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.policy = make_policy(config.batching, config.scheduler_config(), self.block_manager)
        self.runner = ModelRunner(model, self.kv_cache)
        self.requests: dict[str, _Request] = {}
        self.eos_token_ids = tuple(self.loaded.eos_token_ids)
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
        """
        resumed = list(output_token_ids or ())
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the context window of {self.max_model_len} tokens"
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
        detok = IncrementalDetokenizer.create(self.loaded.tokenizer, prompt_token_ids, params.stop)
        for token in resumed:
            detok.add(token)
        self.policy.add_request(seq)
        self.requests[request_id] = _Request(
            seq, SamplerState.create(params, self.device, num_drawn=len(resumed)), detok
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; its KV blocks are free when this returns."""
        if self.policy.abort(request_id, time.monotonic()) is None:
            return None
        return self._final_output(self.requests.pop(request_id))

    def reset(self) -> None:
        """Drop every request (after a failed step, or when they were handed to another worker).
        A step that raised may have left the scheduler half-updated: if the block accounting no
        longer adds up, start from a fresh pool and policy (the KV tensors are reused)."""
        for request_id in list(self.requests):
            try:
                self.abort(request_id)
            except Exception:  # a half-updated sequence: the integrity check below decides
                self.requests.pop(request_id, None)
        try:
            if self.policy.has_unfinished():
                raise AssertionError("requests left after aborting them all")
            self.block_manager.check_integrity()
            if self.block_manager.num_used_blocks:
                raise AssertionError(f"{self.block_manager.num_used_blocks} blocks still used")
        except AssertionError as e:
            logger.warning("engine state rebuilt after a failed step: %s", e)
            config = self.config
            self.block_manager = KVBlockManager(
                self.capacity.num_blocks, config.block_size, config.enable_prefix_caching
            )
            self.policy = make_policy(
                config.batching, config.scheduler_config(), self.block_manager
            )

    def has_unfinished(self) -> bool:
        return self.policy.has_unfinished()

    def flush(self) -> None:
        """No more requests will come (offline runs): static batching launches a partial batch."""
        self.policy.flush()

    # ----- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.policy.schedule(time.monotonic())
        sampled = self._run(plan) if not plan.is_empty else {}
        return self._postprocess(plan, sampled)

    def _run(self, plan: StepPlan) -> dict[str, int]:
        logits = self.runner.execute(plan, self.policy.seqs, self.block_manager.block_table)
        sampling_ids = [c.seq_id for c in plan.chunks if c.samples]
        tokens = sample(logits, [self.requests[i].sampler for i in sampling_ids])
        return dict(zip(sampling_ids, tokens, strict=True))

    def _postprocess(self, plan: StepPlan, sampled: dict[str, int]) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        stopped = set()
        for seq_id, token in sampled.items():
            req = self.requests[seq_id]
            out = outputs[seq_id] = RequestOutput(seq_id, [token], req.detok.add(token))
            if req.detok.stopped:
                stopped.add(seq_id)
            out.num_output_tokens = req.seq.num_output_tokens + 1
        for seq in self.policy.update(plan, sampled, stopped, time.monotonic()):
            final = self._final_output(self.requests.pop(seq.seq_id))
            delta = outputs.pop(seq.seq_id, None)
            if delta is not None:
                final.new_token_ids = delta.new_token_ids
                final.delta_text = delta.delta_text + final.delta_text
            outputs[seq.seq_id] = final
        if not self.policy.has_unfinished():
            self.block_manager.check_integrity()  # cheap; idle is when leaks would show
        return list(outputs.values())

    def _final_output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            seq.seq_id,
            delta_text=req.detok.finish(),
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

    def absorb(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.delta_text
        if out.finished:
            self.finish_reason = out.finish_reason
            self.num_cached_tokens = out.num_cached_tokens
