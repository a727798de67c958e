"""The engine: a model on a paged KV cache, driven step by step by a batching policy.

Usable offline (`generate`) and by the service's engine loop (`add_request` / `step` / `abort`).
One step = schedule -> run (one forward pass over the mixed batch, then sampling) ->
postprocess (outputs, stops, finished requests released). Start-up planning is
engine/startup.py, a request's n choices engine/choices.py, what follows the forward
engine/sampling_pipeline.py, the outputs engine/outputs.py, embeddings (pooling requests)
engine/pooling.py, speculative decoding's draft model engine/draft_model.py (its proposals are
computed at the top of a step, before the plan); callers outside the engine read it through
`Engine.view` (engine/engine_view.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial

import torch

from engine.capacity import KVCapacity
from engine.choices import ChoiceFactory, ChoiceTable, resumed_choices
from engine.config import EngineConfig
from engine.draft_model import DraftModel, load_draft_model
from engine.engine_view import EngineView
from engine.errors import (
    DuplicateRequestError,
    LogitBiasError,
    PredictionError,
    RequestRejected,
    RequestTooLongError,
)
from engine.grammar_masks import Grammars
from engine.lora.adapter_set import AdapterSet
from engine.models.llama import LlamaForward
from engine.models.model_loader import LoadedModel, load_model
from engine.models.noop_model import NOOP
from engine.outputs import (
    CompletedRequest,
    RequestOutput,
    final_output,
    pooled_output,
    step_outputs,
    stop_strings_found,
)
from engine.pooling import Pooler, normalize
from engine.sampling_pipeline import StepResult, grammar_masks, sample_rows, sampling_rows
from engine.speculative import GrammarChecked
from engine.startup import plan_engine
from engine.step_timing import PhaseClock, StepTiming, sync_device
from engine.thread_governor import adapt as adapt_threads
from generation.sampling_params import SamplingParams
from scheduler import (
    BatchingPolicy,
    BlockIntegrityError,
    KVBlockManager,
    SchedulerStats,
    StepPlan,
    make_policy,
)
from scheduler.speculation import speculator_for

logger = logging.getLogger("jitney.engine")


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
            chat_template=config.chat_template,
        )
        # Loaded before the KV budget is measured (on CUDA its weights count against it).
        draft = load_draft_model(config, self.loaded, progress)
        self.startup = plan_engine(config, self.loaded)  # memory, capacity, KV pool, graphs
        self.scheduler_config = config.scheduler_config(
            self.startup.speculative_max_step_tokens, self.startup.speculative_draft_row_cost
        )
        self.kv_cache = self.startup.kv_cache
        self.runner = self.startup.runner
        # Speculative decoding's draft model on its own pool (None: none; engine/draft_model.py).
        self.drafter = (
            None
            if draft is None
            else DraftModel(config, draft, self.startup.draft_kv_bytes, self.vocab_size)
        )
        self.choices = ChoiceTable()  # every live choice of every request
        # One source of truth: the blocks the memory budget yields are the scheduler's budget.
        self.block_manager, self.policy = self._fresh_scheduler()
        self.pooler = Pooler(config.pooling)  # the pooling (embedding) requests' progress
        self.eos_token_ids = tuple(self.loaded.eos_token_ids)
        self.grammars = Grammars(self.loaded.tokenizer, self.vocab_size, self.eos_token_ids)
        self._factory = ChoiceFactory(self.loaded.tokenizer, self.eos_token_ids, self.grammars)
        self.adapters = self._adapter_set()  # LoRA adapters served by name (engine/lora/)
        self.runner.adapters = self.adapters
        self.view = EngineView(self)  # what code outside the engine reads
        self.last_step_timing = StepTiming()  # the phases of the last step (the worker exports)
        self.last_idle_check_s = 0.0  # the pool check the last step ran if it left us idle
        if progress is not None:
            progress(self.capacity.table())

    def _fresh_scheduler(self) -> tuple[KVBlockManager, BatchingPolicy]:
        config = self.config
        blocks = KVBlockManager(
            self.capacity.num_blocks, config.block_size, config.enable_prefix_caching
        )
        # Who proposes: the draft model where there is one (else what the method says), its
        # drafts cut where a grammar refuses them before the scheduler's plan sees them.
        speculator = speculator_for(
            self.scheduler_config.speculative,
            self.drafter,
            partial(GrammarChecked, choices=self.choices),
        )
        policy = make_policy(config.batching, self.scheduler_config, blocks, speculator)
        return blocks, policy

    def _adapter_set(self) -> AdapterSet:
        forward = self.runner.model_forward
        config, model_config = self.config, self.loaded.config
        targets = forward.lora_targets() if isinstance(forward, LlamaForward) else None
        if config.lora_modules and targets is None:
            raise ValueError(
                "LoRA adapters run on Jitney's forward; this model runs transformers' "
                "(a family Jitney's forward does not cover, or --model-impl transformers)"
            )
        heads = getattr(model_config, "num_attention_heads", 0) if targets else 0
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        return AdapterSet(
            targets, config.lora_modules, config.max_loras, config.max_lora_rank, heads, kv_heads
        )

    # ----- LoRA adapters ---------------------------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters a request may name (`add_request(lora=...)`)."""
        return self.adapters.names

    def add_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at `path` (a PEFT directory or a GGUF adapter) as `name`, read and
        checked now. Raises AdapterLoadError (a bad file, a module or rank not covered, an
        adapter of that name in use)."""
        self.adapters.add(name, path, self._adapters_in_use())

    def remove_adapter(self, name: str) -> None:
        """Stop serving `name`. Raises UnknownAdapterError, or AdapterLoadError while a live
        request runs under it."""
        self.adapters.remove(name, self._adapters_in_use())

    def _adapters_in_use(self) -> set[str]:
        return {s.adapter for s in self.policy.seqs.values() if s.adapter is not None}

    @property
    def capacity(self) -> KVCapacity:
        return self.startup.capacity

    @property
    def decode_attention(self) -> str:
        """What decode tokens attend through: "triton" or "native" (in place), or "gather"."""
        return self.kv_cache.decode_kernel or "gather"

    @property
    def decode_kernel_unused_because(self) -> str | None:
        return self.startup.decode_kernel_unused_because  # (bench/gpu_check.py reports it)

    @property
    def max_model_len(self) -> int:
        return self.capacity.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size

    @property
    def embedding_size(self) -> int:
        """The length of a pooling request's vector (the hidden size); 0: no embeddings (noop
        has no hidden states)."""
        return 0 if self.loaded.name == NOOP else self.loaded.hidden_size

    @property
    def stats(self) -> SchedulerStats:
        """Filled by the scheduler when it plans a step; running/waiting are as planned."""
        return self.policy.stats

    # ----- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_token_ids: list[int] | Mapping[int, list[int]] | None = None,
        priority: int = 0,
        embed: bool = False,
        lora: str | None = None,
    ) -> None:
        """Queue a request. Raises what engine.errors.REJECTIONS names (ValueErrors) when it
        refuses the request; nothing is queued then.

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

        `embed`: a pooling request (engine/pooling.py): its prompt is computed as any other's
        and it ends with its vector (`RequestOutput.embedding`) instead of tokens; `params`
        are not read (it samples nothing it shows). The prompt alone must fit the context.

        `lora`: the name of a LoRA adapter the engine serves (`adapter_names`; engine/lora/) that
        every row of the request runs under; None: the base model.
        """
        if embed:
            if not self.embedding_size:
                raise RequestRejected(f"model {self.loaded.name!r} serves no embeddings")
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        resumed = resumed_choices(params, output_token_ids)
        self._check(request_id, prompt_token_ids, params, embed)
        if lora is not None:
            self.adapters.check(lora)  # UnknownAdapterError before anything is queued
        arrival = time.monotonic() if arrival_time is None else arrival_time
        reqs = [
            self._factory.build(
                request_id, i, prompt_token_ids, params, arrival, tokens, priority, lora
            )
            for i, tokens in sorted(resumed.items())
        ]  # every choice is built (and checked) before any is queued
        self.choices.add(reqs, self.policy)
        if embed:
            self.pooler.add(reqs[0].seq)

    def _check(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, embed: bool
    ) -> None:
        num_prompt = len(prompt_token_ids)
        if embed and num_prompt > self.max_model_len:  # its one token is never computed
            raise RequestTooLongError(
                f"prompt ({num_prompt} tokens) exceeds the context window of "
                f"{self.max_model_len} tokens"
            )
        total = num_prompt + params.max_tokens
        if not embed and total > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the context window of {self.max_model_len} tokens"
            )
        if any(token >= self.vocab_size for token, _ in params.logit_bias):
            raise LogitBiasError(
                f"logit_bias names token ids outside the vocabulary (size {self.vocab_size})"
            )
        if any(token >= self.vocab_size for token in params.prediction_token_ids):
            raise PredictionError(
                f"prediction holds token ids outside the vocabulary (size {self.vocab_size})"
            )
        if request_id in self.choices.by_request:
            raise DuplicateRequestError(f"duplicate request id {request_id!r}")

    def abort(self, request_id: str, index: int | None = None) -> list[RequestOutput]:
        """End a request now (or one of its choices); its KV blocks are free when this returns.
        The final output of every choice that was still running (none if it was unknown)."""
        ended = self.choices.abort(request_id, index, self.policy, time.monotonic())
        for req in ended:
            self.pooler.discard(req.seq.seq_id)
        self._forget_drafts(req.seq.seq_id for req in ended)
        return [final_output(req) for req in ended]

    def reset(self) -> None:
        """Drop every request (after a failed step, or when they were handed to another worker).
        A step that raised may have left the scheduler half-updated: if the block accounting no
        longer adds up, start from a fresh pool and policy (the KV tensors are reused)."""
        failed = []
        for request_id in list(self.choices.by_request):
            try:
                self.abort(request_id)
            except Exception:  # a half-updated sequence: its scheduler state cannot be trusted
                logger.exception("abort_failed request=%s (engine reset)", request_id)
                failed.append(request_id)
        # What an abort left behind (a failed one, a finished static-batch mate) goes too.
        self.choices.clear()
        self.pooler.clear()
        if self.drafter is not None:
            self.drafter.reset()
        broken = f"aborting {failed} raised" if failed else self._unreusable_state()
        if broken is not None:
            logger.warning("engine state rebuilt after a failed step: %s", broken)
            self.block_manager, self.policy = self._fresh_scheduler()

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
        adapt_threads()  # an automatic thread count follows the CPUs others leave free
        clock = PhaseClock()
        if self.drafter is not None:  # the drafts the plan may verify, one batched pass each
            self.drafter.draft(self.policy.running, self.policy.speculator)
            clock.lap("propose")
        plan = self.policy.schedule(time.monotonic())
        clock.lap("schedule")
        self._forget_drafts(plan.preempted_seq_ids)
        result = self._run(plan, clock) if not plan.is_empty else StepResult()
        outputs = self._postprocess(plan, result)
        clock.lap("postprocess")
        if plan.chunks and not any(chunk.is_prefill for chunk in plan.chunks):
            self.policy.speculator.row_cost.observe(plan.num_batched_tokens, clock.timing.total)
            clock.lap("postprocess")  # the pricing's own time, so the phases still cover the step
        self.last_step_timing = clock.timing
        self._check_pool_if_idle()
        return outputs

    def _run(self, plan: StepPlan, clock: PhaseClock) -> StepResult:
        """One forward pass over the plan's chunks, then the sampling pipeline."""
        rows = sampling_rows(plan, self.choices)
        pooled = self.pooler.rows(plan)
        inputs = self.runner.prepare(
            plan, self.policy.seqs, self.block_manager.block_ids, rows.extra_rows, pooled
        )
        clock.lap("prepare")
        logits, hidden = self.runner.forward(inputs)
        if hidden is not None:
            self.pooler.absorb(plan, pooled, hidden)
        masks = grammar_masks(self.grammars, rows)  # while the forward runs (on a GPU)
        sync_device(self.device)  # the forward's lap ends when its kernels do (step_timing.py)
        clock.lap("forward")
        result = sample_rows(logits, plan, rows, self.choices, masks)
        clock.lap("sample")
        return result

    def _postprocess(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """The step's outputs; the scheduler told what ended (a stop string or a completed
        grammar among them), and those choices get their final output instead."""
        outputs = step_outputs(result, self.choices)
        stopped = result.grammar_done | stop_strings_found(outputs, self.choices)
        # Choices whose choice 0 sampled: its prompt is computed, the others may start.
        self.choices.release_computed(result.sampled, self.policy)
        finished = self.policy.update(
            plan, result.sampled, stopped, time.monotonic(), result.accepted
        )
        self._forget_drafts(seq.seq_id for seq in finished)
        for seq in finished:
            delta = outputs.pop(seq.seq_id, None)
            final = final_output(self.choices.forget(seq.seq_id), delta)
            if seq.seq_id in self.pooler:
                final = pooled_output(final, self.pooler.take(seq.seq_id))
            outputs[seq.seq_id] = final
        if self.pooler.by_seq:  # a pooling request held in a static batch: its token is no output
            for seq_id in [i for i in outputs if i in self.pooler]:
                del outputs[seq_id]
        return list(outputs.values())

    def _forget_drafts(self, seq_ids: Iterable[str]) -> None:
        """Sequences that left the batch: their draft model mirrors go (engine/draft_model.py)."""
        if self.drafter is not None:
            for seq_id in seq_ids:
                self.drafter.forget(seq_id)

    def _check_pool_if_idle(self) -> None:
        """Idle is when a leak would show. O(pool blocks), once per idle period (29 ms for a
        1 GiB pool of tiny-random blocks), so outside the per-step phases it would skew; timed
        on its own, so a bench can leave it out of its per-step figures."""
        self.last_idle_check_s = 0.0
        if not self.policy.has_unfinished():
            start = time.perf_counter()
            self.block_manager.check_integrity()
            if self.drafter is not None:
                self.drafter.check_integrity(())
            self.last_idle_check_s = time.perf_counter() - start

    # ----- offline -------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        lora: str | list[str | None] | None = None,
    ) -> list[CompletedRequest]:
        """Run prompts to completion on an idle engine; results in input order. `lora`: the
        adapter every prompt runs under, or one per prompt (None: the base model)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if any(p.n > 1 for p in params_list):
            raise ValueError("generate() returns one result per prompt: use add_request for n > 1")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        return self._offline(prompts, params_list, loras=loras)

    def embed(self, prompts: list[list[int]], normalized: bool = True) -> list[torch.Tensor]:
        """Each prompt's embedding (float32 [hidden]) on an idle engine, in input order: pooled
        as `config.pooling` says, L2-normalised unless `normalized` is False."""
        done = self._offline(prompts, [SamplingParams()] * len(prompts), embed=True)
        vectors = [r.embedding for r in done]
        assert all(v is not None for v in vectors), [r.finish_reason for r in done]
        return [normalize(v) if normalized else v for v in vectors]  # type: ignore[arg-type]

    def _offline(
        self,
        prompts: list[list[int]],
        params_list: list[SamplingParams],
        embed: bool = False,
        loras: list[str | None] | None = None,
    ) -> list[CompletedRequest]:
        if self.has_unfinished():
            raise RuntimeError("offline runs need an idle engine; use add_request/step instead")
        results = {}
        loras = loras or [None] * len(prompts)
        for i, (prompt, p, lora) in enumerate(zip(prompts, params_list, loras, strict=True)):
            rid = f"offline-{i}"
            self.add_request(rid, prompt, p, embed=embed, lora=lora)
            results[rid] = CompletedRequest(rid, list(prompt))
        self.flush()
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].absorb(out)
        return list(results.values())
